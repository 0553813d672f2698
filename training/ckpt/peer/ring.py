"""The buddy ring of the peer tier: which node holds which node's copies (training/ckpt/peer/tier.py;
the sharded holders build on it, training/ckpt/peer/shardset.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("gts.peer")
ZONE_VAR = "GTS_ZONE"


def node_zone(env: Mapping[str, str] = os.environ) -> str:
    """This node's zone: GTS_ZONE where set (set empty: no zone, not asked again), else the answer
    of its cloud's metadata service (GTS_CLOUD's ZONE_PATH: a VM node; a Job's pod is kept from it
    by its network policy), else "" (the buddies then go round in node order, as within one zone).
    The node's entrypoint asks once and sets GTS_ZONE for its workers, so a restart does not ask
    again, nor wait again on a service that does not answer (`python -m training.ckpt.peer.ring`)."""
    if ZONE_VAR in env:
        return env[ZONE_VAR]
    cloud = env.get("GTS_CLOUD", "")
    if not cloud:
        return ""
    import http.client

    from training import cloudmeta

    try:
        meta = cloudmeta.Metadata(cloud, env.get("GTS_METADATA_URL") or None)
        zone = meta.get(meta.cloud_meta.ZONE_PATH, missing_ok=True) or ""
    except (cloudmeta.MetadataError, cloudmeta.UnknownCloud, OSError, ValueError, http.client.HTTPException) as exc:
        # HTTPException: an answer that is not HTTP (BadStatusLine, IncompleteRead), which urllib
        # raises as it is
        log.warning("this node's zone is unknown (%s; set %s): its peer copies go to the next node", exc, ZONE_VAR)
        return ""
    return zone if zone.replace("-", "").replace("_", "").isalnum() and len(zone) <= 64 else ""


def buddy(node: int, zones: list[str]) -> int:
    """The node that holds node `node`'s copies: one in another zone when the run spans zones,
    else the next node. The nodes in zone order, each sends to the one `m` places on (m: the
    largest zone's count): every node then holds one node's copies, each from another zone.
    Where one zone holds more than half the nodes, its nodes deal theirs to the others in turn."""
    count = len(zones)
    other = [n for n in range(count) if zones[n] != zones[node]]
    if not other:
        return (node + 1) % count
    largest = max(zones.count(z) for z in set(zones))
    if 2 * largest <= count:
        ring = sorted(range(count), key=lambda n: (zones[n], n))
        return ring[(ring.index(node) + largest) % count]
    return other[sum(1 for n in range(node) if zones[n] == zones[node]) % len(other)]


if __name__ == "__main__":  # the entrypoint's one question: this node's zone, or an empty line
    logging.basicConfig(format="entrypoint: %(message)s")
    try:
        print(node_zone())
    except Exception as exc:  # noqa: BLE001 (a zone is optional: whatever went wrong costs the zones, never the run)
        log.warning("this node's zone is unknown (%s: %s; set %s): its peer copies go to the next node",
                    type(exc).__name__, exc, ZONE_VAR)
        print()
