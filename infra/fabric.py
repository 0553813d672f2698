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
from typing import TYPE_CHECKING, TypedDict

from infra import catalog as cat
from infra.clouds import profile, profiles
from policies.gts_policy import catalog as pack_catalog
from infra.errors import CatalogError, Problem
from infra.spec import NodeGroup, StackSpec

if TYPE_CHECKING:
    from infra.groups import ResolvedGroup, Stack

PATH = cat.DATA_DIR / "fabric.csv"
SCHEMA = 1
COLUMNS = ("cloud", "instance_type", "fabric", "interfaces", "devices", "gbps", "busbw_gbs", "jumbo_frames",
           "efa_primary_every", "verified", "source")
# The fabric each cloud has (its profile: infra/clouds/<cloud>/profile.py fabric, with what its
# ordinary network gives NCCL instead, its placement resource and that resource's cost), and
# what each fabric is called in messages.
OF_CLOUD = {p.name: p.fabric for p in profiles()}
NAMES = {"efa": "EFA (Elastic Fabric Adapter)", "erdma": "eRDMA (elastic RDMA)", "hcc": "HCC RDMA"}


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
    efa_primary_every: int  # AWS: every n-th card is "efa" (ENA+EFA), the rest "efa-only"; 0: card 0 only
    verified: bool
    source: str

    def interface_types(self) -> list[str]:
        """AWS: the interface type of each network card, card 0 first (ENA+EFA primary; layout
        (A) of the sources: pulumi-eks instances.ts, terraform-aws-eks, dstack, SkyPilot)."""
        every = self.efa_primary_every
        return ["efa" if i == 0 or (every and i % every == 0) else "efa-only" for i in range(self.interfaces)]


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
        if item.fabric == "hcc" and item.interfaces != 0:
            raise CatalogError(f"{where}: HCC RDMA ports come with the HCC cluster; interfaces must be 0")
        if item.fabric != "hcc" and item.interfaces < 1:
            raise CatalogError(f"{where}: an {item.fabric} type declares at least one interface")
        if item.fabric == "efa" and item.interfaces != item.devices:
            raise CatalogError(f"{where}: each EFA interface is one EFA device; interfaces must equal devices")
        if item.efa_primary_every and item.fabric != "efa":
            raise CatalogError(f"{where}: efa_primary_every applies to efa rows only")
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
    multi-node training group; efa | erdma | hcc: the type's (validation has checked it has it)."""
    if group.fabric == "none":
        return None
    found = of_type(group.cloud, primary_type)
    if group.fabric == "auto" and (not multi_node(group) or unbuildable(group)):
        return None
    return found


def unbuildable(group: NodeGroup) -> str | None:
    """Why the stack cannot give this kind of group its cloud's fabric, or None."""
    return profile(group.cloud).fabric_unbuildable(group.kind, group.market.type)  # infra/clouds/<cloud>/profile.py


def signature(cloud: str, instance_type: str) -> tuple[str, int, int] | None:
    """What must be equal across a fabric group's types: fabric, interfaces, devices."""
    f = of_type(cloud, instance_type)
    return (f.fabric, f.interfaces, f.devices) if f else None


def same_fabric(cloud: str, types: Sequence[str]) -> list[str]:
    """The selector's picks a fabric group keeps: those with the first pick's fabric and counts
    (one launch configuration declares one interface layout)."""
    first = signature(cloud, types[0]) if types else None
    return [t for t in types if signature(cloud, t) == first]


def _with_fabric(cloud: str) -> str:
    return ", ".join(t for (c, t) in load() if c == cloud) or "none"


def check(spec: StackSpec) -> list[Problem]:
    """The fabric of each group against its types and cloud (run on a spec whose groups are
    otherwise valid)."""
    from infra.groups import instance_types

    out: list[Problem] = []
    catalog = spec.catalog()
    for i, group in enumerate(spec.node_groups):
        path = f"nodeGroups[{i}]"
        types = list(instance_types(spec, group, catalog))
        if not types:
            continue
        own = OF_CLOUD[group.cloud]
        if group.fabric not in ("auto", "none") and group.fabric != own:
            out.append(Problem(f"{path}.fabric", f"node group {group.name}: {group.fabric!r} is not a fabric of "
                                                 f"{cat.CLOUD_NAMES[group.cloud]}; its fabric is {own!r} "
                                                 f"(or use auto / none)"))
            continue
        primary = of_type(group.cloud, types[0])
        if group.fabric == own and primary is None:
            out.append(Problem(f"{path}.fabric", f"node group {group.name}: {types[0]} has no {NAMES[own]}; "
                                                 f"pick a type that has one ({_with_fabric(group.cloud)}), or "
                                                 f"set fabric: auto / none"))
            continue
        why = unbuildable(group)
        if group.fabric == own and why:
            out.append(Problem(f"{path}.fabric", f"node group {group.name}: {why}; use kind: vm for an "
                                                 f"{NAMES[own]} group, or fabric: auto / none"))
            continue
        fabric = wanted(group, types[0])
        if fabric is None:
            continue
        if fabric.fabric == "hcc" and (group.scaling.min != group.scaling.max or group.schedule):
            out.append(Problem(f"{path}.scaling", f"node group {group.name}: an HCC group is {group.scaling.max} fixed "
                                                  "CVM instances in its HCC cluster (Auto Scaling cannot place "
                                                  "instances in one through the provider), so it has no range or "
                                                  f"schedule: set min = max = {group.scaling.max} and no schedule, "
                                                  "or fabric: none"))
        first = signature(group.cloud, types[0])
        for k, name in enumerate(types[1:], start=1):
            if signature(group.cloud, name) != first:
                theirs = of_type(group.cloud, name)
                has = f"{theirs.interfaces} interfaces / {theirs.devices} devices" if theirs else "no fabric"
                out.append(Problem(f"{path}.fallbackTypes", f"node group {group.name}: {name} has {has}, "
                                                            f"{types[0]} {fabric.interfaces} / {fabric.devices}: "
                                                            "one launch configuration cannot declare both layouts "
                                                            f"(mixing them is not supported); list only types "
                                                            f"with the same counts, or set fabric: none"))
                break
    return out


def advisories(stack: Stack) -> list[dict[str, str]]:
    """Plan advisories: a multi-node training group on a fabric type that turns it off, with
    what that costs."""
    out = []
    for rg in stack.groups:
        found = of_type(rg.cloud, rg.types[0])
        if rg.group.fabric != "none" or found is None or not multi_node(rg.group):
            continue
        out.append({
            "policy": "fabric-used", "enforcement": "advisory", "resource": rg.name,
            "message": f"{rg.path} ({rg.name}): up to {rg.max_nodes} x {rg.types[0]} with fabric: none — NCCL "
                       f"runs over {profile(rg.cloud).plain_network} instead of {found.devices} {NAMES[found.fabric]} "
                       f"devices ({found.gbps} Gbps, about {found.busbw_gbs} GB/s all-reduce bus bandwidth): "
                       f"gradient all-reduce several times slower on nodes that cost "
                       f"${rg.prices.on_demand:,.2f}/h each with the fabric paid for. Remove fabric: none "
                       "(auto uses it)"})
    return out


def placement(rg: ResolvedGroup) -> str:
    """What keeps a fabric group's nodes together (an ESS scaling configuration cannot take a
    deployment set: infra/data/capabilities.yaml sdkGaps)."""
    return profile(rg.cloud).fabric_placement(rg.kind, rg.market.type)


class Summary(TypedDict):
    fabric: str
    fabric_interfaces: int
    fabric_devices: int
    fabric_gbps: int
    placement: str
    placement_monthly_usd: float


def summary(rg: ResolvedGroup) -> Summary:
    """The plan's fabric columns of one group (cost.GroupCost)."""
    f = rg.fabric
    return {"fabric": f.fabric if f else "none", "fabric_interfaces": f.interfaces if f else 0,
            "fabric_devices": f.devices if f else 0, "fabric_gbps": f.gbps if f else 0,
            "placement": placement(rg) if f else "",
            "placement_monthly_usd": profile(rg.cloud).placement_monthly_usd if f else 0.0}
