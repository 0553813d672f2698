"""The fabric of the resolved node groups (infra/fabric.py has what each type has and which
groups want one): a group's fabric against its resolved types and cloud (a validation rule,
exit 2 naming the group, the type and the fix), the plan's fabric columns and placement per
group, and its advisory when a multi-node group turns a fabric off."""

from __future__ import annotations

from typing import TypedDict

from infra.clouds import profile
from infra.core import catalog as cat
from infra.core.errors import Problem
from infra.fabric import load, multi_node, of_type, signature, unbuildable
from infra.model.spec import StackSpec
from infra.resolve.groups import ResolvedGroup, Stack, pick


def _with_fabric(cloud: str) -> str:
    return ", ".join(t for (c, t) in load() if c == cloud) or "none"


def check(spec: StackSpec) -> list[Problem]:
    """The fabric of each group against its types and cloud (run on a spec whose groups are
    otherwise valid)."""
    out: list[Problem] = []
    catalog = spec.catalog()
    for i, group in enumerate(spec.node_groups):
        path = f"nodeGroups[{i}]"
        picked = pick(spec, group, catalog)
        types = list(picked.types)
        if not types:
            continue
        cloud = profile(group.cloud)
        own = cloud.fabric
        if group.fabric not in ("auto", "none") and group.fabric != own:
            out.append(Problem(f"{path}.fabric", f"node group {group.name}: {group.fabric!r} is not a fabric of "
                                                 f"{cat.CLOUD_NAMES[group.cloud]}; its fabric is {own!r} "
                                                 f"(or use auto / none)"))
            continue
        primary = of_type(group.cloud, types[0])
        if group.fabric == own and primary is None:
            out.append(Problem(f"{path}.fabric", f"node group {group.name}: {types[0]} has no {cloud.fabric_name}; "
                                                 f"pick a type that has one ({_with_fabric(group.cloud)}), or "
                                                 f"set fabric: auto / none"))
            continue
        why = unbuildable(group)
        if group.fabric == own and why:
            out.append(Problem(f"{path}.fabric", f"node group {group.name}: {why}; use kind: vm for an "
                                                 f"{cloud.fabric_name} group, or fabric: auto / none"))
            continue
        fabric = picked.fabric
        if fabric is None:
            continue
        fixed = cloud.fabric_fixed_count(group.scaling.max)
        if fixed and (group.scaling.min != group.scaling.max or group.schedule):
            out.append(Problem(f"{path}.scaling", f"node group {group.name}: {fixed}, so it has no range or "
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
                       f"runs over {profile(rg.cloud).plain_network} instead of {found.devices} {profile(rg.cloud).fabric_name} "
                       f"devices ({found.gbps} Gbps, about {found.busbw_gbs} GB/s all-reduce bus bandwidth): "
                       f"gradient all-reduce several times slower on nodes that cost "
                       f"${rg.prices.on_demand:,.2f}/h each with the fabric paid for. Remove fabric: none "
                       "(auto uses it)"})
    return out


def placement(rg: ResolvedGroup) -> str:
    """What keeps a fabric group's nodes together (an ESS scaling configuration cannot take a
    deployment set: infra/data/capabilities.yaml sdkGaps)."""
    return profile(rg.cloud).fabric_placement(rg.kind, rg.market)


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
