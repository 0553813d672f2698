"""GPU health settings a node group's nodes get (cloudinit/scripts/gts-gpu-health.py reads them
from node.env; the Kubernetes Job's init container from its env): the type's GPU count, NVSwitch,
the active NVLinks per GPU and the DCGM diagnostic level, from the catalog and
infra/data/gpu_health.yaml (which also classifies the Xid codes the node's watch acts on)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infra.core import catalog as cat

if TYPE_CHECKING:
    from infra.resolve.groups import ResolvedGroup

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


def diag_level(rg: ResolvedGroup) -> int:
    """The group's `dcgmi diag` level (nodeGroups[].gpuHealth.diagLevel; the table's default is 1)."""
    return int(rg.group.gpu_health.diag_level)


def replace_mode(rg: ResolvedGroup) -> str:
    """group: a faulty node hands itself back to its scaling group; none: every node of the group
    is a fixed instance (as its cloud's fleet builds it: infra/clouds/<cloud>/fleet.py), and a
    faulty node is quarantined for the operator (GTS_REPLACE). A Tencent spot group's on-demand
    base shares its group's user data: its nodes' hand-back is refused and they are quarantined
    (hand_back_failed)."""
    from infra.clouds import fixed_instances  # the cloud packages import this module's callers

    return "none" if rg.kind == "vm" and fixed_instances(rg) >= rg.scaling.max else "group"


def node_env(rg: ResolvedGroup) -> dict[str, str]:
    """The gate's expectations for one group's nodes (node.env / the init container's env)."""
    return {"GTS_GPU_COUNT": str(rg.gpus), "GTS_NVSWITCH": str(rg.primary.nvswitch).lower(),
            "GTS_NVLINKS": str(nvlinks(rg)), "GTS_GPU_DIAG_LEVEL": str(diag_level(rg))}


def advisories(groups: Sequence[ResolvedGroup]) -> list[dict[str, str]]:
    """The plan's advisory for each group whose gate runs the longer DCGM level (its minutes)."""
    levels = load()["diag_levels"]
    return [{"policy": "gpu-diag-level", "enforcement": "advisory", "resource": rg.name,
             "message": f"nodeGroups[{rg.name}].gpuHealth.diagLevel: {diag_level(rg)} ({levels[diag_level(rg)]['name']}) "
                        f"runs `dcgmi diag -r {diag_level(rg)}` on every node start before its trainer: "
                        f"{levels[diag_level(rg)]['minutes']} minutes (level 1: {levels[1]['minutes']})"}
            for rg in groups if diag_level(rg) != int(load()["default_diag_level"])]
