"""Each node group resolved once: instance types, hardware, disks, prices, price cap and where
its checkpoints go. Components, the cost model, the user data and the Kubernetes Jobs take a
`ResolvedGroup` (and the few stack values they need) instead of recomputing these from the
whole spec."""

from __future__ import annotations

from dataclasses import dataclass, replace

from infra import fabric as fab
from infra.buckets import bucket
from infra.contract import trainer_env
from infra.core import catalog as cat
from infra.resolve.resolved import (GROUP_LABELS, LABEL_CAPACITY, LABEL_GPU_MODEL, LABEL_NODE_GROUP, LABEL_POOL, LABEL_WORKLOAD,
                            SYSTEM_DISK_GB, TAG_NODE_GROUP, TAG_WORKLOAD, NodePrices, ResolvedGroup, Stack)
from infra.model.spec import GpuRequirement, NodeGroup, ScheduleAction, StackSpec

__all__ = ["GROUP_LABELS", "LABEL_CAPACITY", "LABEL_GPU_MODEL", "LABEL_NODE_GROUP", "LABEL_POOL", "LABEL_WORKLOAD",
           "SYSTEM_DISK_GB", "TAG_NODE_GROUP", "TAG_WORKLOAD", "NodePrices", "Picked", "ResolvedGroup", "Stack",
           "instance_types", "pick", "requirement", "resolve", "resolve_group", "schedule_bounds"]

def schedule_bounds(group: NodeGroup, action: ScheduleAction) -> tuple[int, int]:
    """(min, max) from a scheduled action on: the action's own, else the group's."""
    lo = group.scaling.min if action.min is None else action.min
    hi = group.scaling.max if action.max is None else action.max
    return lo, hi


def requirement(spec: StackSpec, group: NodeGroup) -> cat.Requirement:
    scratch = spec.scratch_of(group)
    gpu = group.gpu or GpuRequirement()
    return cat.Requirement(gpu_count=gpu.count, gpu_model=gpu.model,
                           min_vram_gb=max(gpu.min_vram_gb, group.min_gpu_memory_gb),
                           scratch_gb=scratch.size_gb, scratch_source=scratch.source)


@dataclass(frozen=True)
class Picked:
    """A group's instance types, preferred first, and the fabric its nodes get: decided together,
    once, by `pick` (the fabric narrows the selector's picks to one interface layout)."""

    types: tuple[str, ...]
    fabric: fab.TypeFabric | None


def pick(spec: StackSpec, group: NodeGroup, catalog: cat.Catalog) -> Picked:
    """The group's instance types (the named type or the selector's picks, then the fallbacks)
    and its fabric (infra/fabric.py wanted, on the first type). Every reader takes both from here:
    resolve_group, the fabric check (infra/resolve/fabric_plan.py), the capacity places."""
    if group.instance_type is not None:
        head = [group.instance_type]
    else:
        region = spec.region_of(spec.network(group.network))
        picks = [c for c in cat.select(catalog, [group.cloud], requirement(spec, group), spec.pricing.cny_per_usd,
                                       region)
                 if group.kind != "vm" or not cat.vm_gpu_unsupported(group.cloud, c.type.gpu_model)]
        head = [c.type.instance_type for c in picks[:4]]
    first = (head + group.fallback_types)[:1]
    fabric = fab.wanted(group, first[0]) if first else None
    if fabric is not None and group.instance_type is None:  # one interface layout per launch configuration
        head = fab.same_fabric(group.cloud, head)
    return Picked(tuple(dict.fromkeys(head + group.fallback_types)), fabric)


def instance_types(spec: StackSpec, group: NodeGroup, catalog: cat.Catalog) -> tuple[str, ...]:
    """The group's instance types, preferred first: the named type or the selector's picks."""
    return pick(spec, group, catalog).types


def _prices(spec: StackSpec, group: NodeGroup, item: cat.InstanceType, disk_gb: int) -> NodePrices:
    rate = spec.pricing.cny_per_usd
    on_demand = cat.to_usd(item.price_ondemand, item.currency, rate)
    spot = on_demand * (1 - item.spot_discount)
    if group.market.spot_max_price_usd is not None:
        spot = min(spot, group.market.spot_max_price_usd)
    return NodePrices(on_demand, spot, on_demand * (1 - item.reserved_discount),
                      cat.data_disk_hourly_usd(group.cloud, disk_gb, rate))


def _price_cap(spec: StackSpec, group: NodeGroup, item: cat.InstanceType) -> float | None:
    """spotMaxPriceUsd in the currency the group's cloud bills in: the catalog row's."""
    cap = group.market.spot_max_price_usd
    if cap is None:
        return None
    return round(cap if item.currency == "USD" else cap * spec.pricing.cny_per_usd, 4)


def resolve_group(spec: StackSpec, group: NodeGroup, index: int, catalog: cat.Catalog) -> ResolvedGroup:
    picked = pick(spec, group, catalog)
    types = picked.types
    region = spec.region_of(spec.network(group.network))
    primary = catalog.priced(group.cloud, types[0], region)  # every figure at the group's region's price
    if primary is None:  # validation has checked every type against the catalog and its prices
        raise LookupError(f"{group.name}: {types[0]} has no price in {region}")
    scratch = spec.scratch_of(group)
    disk_gb = cat.scratch_disk_gb(primary, scratch.size_gb, scratch.source) or 0
    return ResolvedGroup(
        group=group, index=index, region=region, types=types,
        primary=primary, scratch_gb=scratch.size_gb, scratch_disk_gb=disk_gb,
        price_cap=_price_cap(spec, group, primary), prices=_prices(spec, group, primary, disk_gb),
        bucket=bucket(spec, group.cloud), fabric=picked.fabric)


def resolve(spec: StackSpec) -> Stack:
    catalog = spec.catalog()
    groups = (resolve_group(spec, g, i, catalog) for i, g in enumerate(spec.node_groups))
    return Stack(spec, tuple(replace(rg, trainer=trainer_env(spec, rg)) for rg in groups))
