"""GPU health settings a node group's nodes get (cloudinit/scripts/gts-gpu-health.py reads them
from node.env; the Kubernetes Job's init container from its env): the type's GPU count, NVSwitch,
the active NVLinks per GPU and the DCGM diagnostic level, from the catalog and
infra/data/gpu_health.yaml (which also classifies the Xid codes the node's watch acts on)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infra import catalog as cat

if TYPE_CHECKING:
    from infra.groups import ResolvedGroup

ACTIONS = ("replace", "restart", "monitor")


def load() -> dict[str, Any]:
    """infra/data/gpu_health.yaml, checked: every Xid in one class only, known actions."""
    doc = cat.load_yaml("gpu_health.yaml")
    seen: dict[int, str] = {}
    for action in ACTIONS:
        for code in doc["xid"][action]["codes"]:
            if code in seen:
                raise ValueError(f"infra/data/gpu_health.yaml: Xid {code} is in both {seen[code]} and {action}")
            seen[int(code)] = action
        if not doc["xid"][action].get("sources"):
            raise ValueError(f"infra/data/gpu_health.yaml: xid.{action} names no source")
    if doc["xid"]["unknown"] not in ACTIONS:
        raise ValueError(f"infra/data/gpu_health.yaml: xid.unknown must be one of {ACTIONS}")
    return doc


def xid_codes(action: str) -> list[int]:
    return sorted(int(c) for c in load()["xid"][action]["codes"])


def nvlinks(rg: ResolvedGroup) -> int:
    """Active NVLinks each GPU must have (0: not checked): NVSwitch types whose GPU model the table knows."""
    if not rg.primary.nvswitch:
        return 0
    return int(load()["nvlinks_per_gpu"].get(rg.primary.gpu_model, 0))


def node_env(rg: ResolvedGroup) -> dict[str, str]:
    """The gate's expectations for one group's nodes (node.env / the init container's env)."""
    return {"GTS_GPU_COUNT": str(rg.gpus), "GTS_NVSWITCH": str(rg.primary.nvswitch).lower(),
            "GTS_NVLINKS": str(nvlinks(rg)), "GTS_GPU_DIAG_LEVEL": str(load()["default_diag_level"])}
