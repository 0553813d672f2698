"""The multi-node fabric of a node group: AWS EFA, Alibaba eRDMA or Tencent HCC RDMA.

What each GPU type has is data (data/fabric.csv: interfaces, devices, bandwidth, each with its
source), read and checked here. A group's `fabric` (auto | none | efa | erdma | hcc) picks it:
auto turns it on for a multi-node training group on a type that has one. This module decides
which groups get a fabric, refuses the combinations the clouds cannot build (exit 2 naming the
group, the type and the fix), gives the plan its advisory when a multi-node group turns a fabric
off, and names the NCCL / libfabric settings the trainer gets for it (infra/contract.py renders
them). The resources are built per cloud (infra/clouds/<cloud>/fleet.py, kubernetes.py); the
node installs and checks the user space (cloudinit/scripts/gts-fabric.sh).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.clouds import profile, profiles
from infra.core import catalog as cat
from policies.gts_policy import catalog as pack_catalog
from infra.core.errors import CatalogError
from infra.model.spec import NodeGroup

PATH = cat.DATA_DIR / "fabric.csv"
SCHEMA = 1
COLUMNS = ("cloud", "instance_type", "fabric", "interfaces", "devices", "gbps", "busbw_gbs", "jumbo_frames",
           "efa_primary_every", "verified", "source")
# The fabric each cloud has (its profile: infra/clouds/<cloud>/profile.py fabric, with what it is
# called, what its rows may hold, what its ordinary network gives NCCL instead, its placement
# resource and that resource's cost).
OF_CLOUD = {p.name: p.fabric for p in profiles()}


@dataclass(frozen=True)
class TypeFabric:
    """The fabric of one GPU type (a row of data/fabric.csv)."""

    cloud: str
    instance_type: str
    fabric: str  # efa | erdma | hcc
    interfaces: int  # network interfaces the launch configuration declares for it
    devices: int  # fabric devices the node must see
    gbps: int  # aggregate fabric bandwidth
    busbw_gbs: int  # expected nccl-tests all_reduce bus bandwidth, GB/s, 2 nodes
    jumbo_frames: bool  # Alibaba: the type takes jumbo frames (MTU 8500)
    efa_primary_every: int  # AWS: every n-th card ENA+EFA, the rest EFA-only (aws/fleet.py); 0: card 0 only
    verified: bool
    source: str


def _bool(text: str, where: str) -> bool:
    if text not in ("true", "false"):
        raise CatalogError(f"{where}: expected true or false, got {text!r}")
    return text == "true"


def load_file(path: Path) -> dict[tuple[str, str], TypeFabric]:
    """Read and check fabric.csv: schema version, exact columns, known clouds and fabrics (each
    cloud its own), counts that fit the fabric, a source on every row, and a catalog type for
    every row."""
    catalog = cat.load_catalog()
    out: dict[tuple[str, str], TypeFabric] = {}
    for where, row in pack_catalog.csv_rows(path, SCHEMA, COLUMNS):
        try:
            item = TypeFabric(row["cloud"], row["instance_type"], row["fabric"], int(row["interfaces"]),
                              int(row["devices"]), int(row["gbps"]), int(row["busbw_gbs"]),
                              _bool(row["jumbo_frames"], where), int(row["efa_primary_every"]),
                              _bool(row["verified"], where), row["source"])
        except ValueError as exc:
            raise CatalogError(f"{where}: {exc}") from None
        if OF_CLOUD.get(item.cloud) != item.fabric:
            raise CatalogError(f"{where}: {item.cloud} types have fabric {OF_CLOUD.get(item.cloud)!r}, "
                               f"not {item.fabric!r}")
        if catalog.get(item.cloud, item.instance_type) is None:
            raise CatalogError(f"{where}: {item.cloud} {item.instance_type} is not in gpu_catalog.csv")
        if item.devices < 1 or item.gbps < 1 or item.busbw_gbs < 1 or not item.source.strip():
            raise CatalogError(f"{where}: devices, gbps and busbw_gbs must be positive, and the row needs a source")
        wrong = profile(item.cloud).fabric_row_problem(item.interfaces, item.devices, item.efa_primary_every)
        if wrong:
            raise CatalogError(f"{where}: {wrong}")
        if (item.cloud, item.instance_type) in out:
            raise CatalogError(f"{where}: duplicate row for {item.cloud} {item.instance_type}")
        out[(item.cloud, item.instance_type)] = item
    return out


@functools.cache
def load() -> dict[tuple[str, str], TypeFabric]:
    return load_file(PATH)


def of_type(cloud: str, instance_type: str) -> TypeFabric | None:
    return load().get((cloud, instance_type))


def multi_node(group: NodeGroup) -> bool:
    """Whether one training run of the group spans several nodes (ResolvedGroup.max_nodes > 1)."""
    if group.workload != "training":
        return False
    return (group.scaling.max if group.kind == "vm" else group.scaling.baseline) > 1


def wanted(group: NodeGroup, primary_type: str) -> TypeFabric | None:
    """The fabric the group's nodes get: none when it says none; auto: the type's, for a
    multi-node training group; its cloud's kind: the type's (validation has checked it has it).
    Asked once per group, on its first type (infra/resolve/groups.py pick)."""
    if group.fabric == "none":
        return None
    found = of_type(group.cloud, primary_type)
    if group.fabric == "auto" and (not multi_node(group) or unbuildable(group)):
        return None
    return found


def unbuildable(group: NodeGroup) -> str | None:
    """Why the stack cannot give this kind of group its cloud's fabric, or None."""
    return profile(group.cloud).fabric_unbuildable(group.kind, group.market)  # infra/clouds/<cloud>/profile.py


def signature(cloud: str, instance_type: str) -> tuple[str, int, int] | None:
    """What must be equal across a fabric group's types: fabric, interfaces, devices."""
    f = of_type(cloud, instance_type)
    return (f.fabric, f.interfaces, f.devices) if f else None


def same_fabric(cloud: str, types: Sequence[str]) -> list[str]:
    """The selector's picks a fabric group keeps: those with the first pick's fabric and counts
    (one launch configuration declares one interface layout)."""
    first = signature(cloud, types[0]) if types else None
    return [t for t in types if signature(cloud, t) == first]
