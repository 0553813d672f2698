"""A node asks its own scaling group to replace it, signed with the instance role's credentials
from the metadata service (training/cloudmeta.py), with the standard library only. The call
itself, its API and why it is that one are the cloud's: `replace_self` in its node module
(infra/clouds/<cloud>/node.py); this module finds the instance, its region and the credentials.

Node-side: the bundle installs it beside cloudmeta.py in /usr/local/lib/gts, and
cloudinit/scripts/gts-gpu-health.py imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from training import cloudmeta
else:  # on a node, /usr/local/lib/gts (on sys.path) holds both files
    import cloudmeta


def api_url(node: cloudmeta.CloudNode, region: str, override: Optional[str]) -> str:
    if override:
        return override.rstrip("/") + "/"
    return node.replace_api_url(region)


def request_replacement(meta: cloudmeta.Metadata, region_override: Optional[str], url_override: Optional[str],
                        group: str, group_id: str) -> Tuple[str, str]:
    """Ask the node's group to replace this instance: (instance id, the cloud's answer). Raises
    OSError / ValueError / KeyError / cloudmeta.MetadataError on a failure (the caller retries)."""
    node = cloudmeta.cloud_node(meta.cloud)
    instance, region = meta.get(node.INSTANCE_ID_PATH), region_override or meta.get(node.REGION_PATH)
    if not (instance and region):
        raise ValueError(f"the metadata service names no instance id or region (instance {instance!r}, "
                         f"region {region!r})")
    creds = meta.credentials()
    return instance, node.replace_self(creds, region, instance, api_url(node, region, url_override), group, group_id)
