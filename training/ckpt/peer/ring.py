"""The buddy ring of the peer tier: which node holds which node's copies (training/ckpt/peer/tier.py;
the sharded holders build on it, training/ckpt/peer/shardset.py)."""

from __future__ import annotations


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
