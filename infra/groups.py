"""Each node group resolved once: instance types, hardware, disks, prices, price cap and where
its checkpoints go. Components, the cost model, the user data and the Kubernetes Jobs take a
`ResolvedGroup` (and the few stack values they need) instead of recomputing these from the
whole spec."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from infra import catalog as cat
from infra import fabric as fab
from infra.buckets import Bucket, bucket
from infra.contract import trainer_env
from infra.spec import GpuRequirement, Market, NodeGroup, ScheduleAction, Scaling, StackSpec

SYSTEM_DISK_GB = 200  # root / system disk of every GPU node, all clouds
# Instance tags: no `/` (AWS refuses it in tags exposed to the instance metadata service).
TAG_NODE_GROUP = "gpu-training-stack:node-group"
TAG_WORKLOAD = "gpu-training-stack:workload"
# Kubernetes node labels (`:` is not allowed there): Jobs select their pool by the first.
LABEL_NODE_GROUP = "gpu-training-stack/node-group"
LABEL_GPU_MODEL = "gpu-training-stack/gpu-model"
LABEL_WORKLOAD = "gpu-training-stack/workload"
LABEL_POOL = "gpu-training-stack/pool"  # "system" on each cluster's untainted add-on pool
# spot | on-demand: how the pool's nodes are bought (a Kueue ResourceFlavor selects on it and the
# GPU model). EKS and TKE buy a spot group's on-demand base as a pool of its own; an ACK pool
# mixes both in one pool and is labelled by its group's market (its base counts as spot).
LABEL_CAPACITY = "gpu-training-stack/capacity"
GROUP_LABELS = (LABEL_NODE_GROUP, LABEL_GPU_MODEL, LABEL_WORKLOAD, LABEL_CAPACITY)


@dataclass(frozen=True)
class NodePrices:
    """USD per node-hour of a group's primary type in each market, and of its scratch data disk."""

    on_demand: float
    spot: float
    reserved: float
    disk: float


@dataclass(frozen=True)
class ResolvedGroup:
    """A node group with everything derived from it and the catalog, computed once."""

    group: NodeGroup
    index: int  # position under nodeGroups, for key paths in messages
    region: str  # region of the group's network
    types: tuple[str, ...]  # instance types, preferred first
    primary: cat.InstanceType  # catalog row of the first type
    scratch_gb: int  # scratch space asked for per node
    scratch_disk_gb: int  # data disk per node for the scratch (0 when local NVMe holds it)
    price_cap: float | None  # spot cap in the catalog row's currency (CNY for Alibaba / Tencent)
    prices: NodePrices
    bucket: Bucket  # the stack's bucket on the group's cloud
    trainer: dict[str, str] = field(default_factory=dict)  # the trainer contract's values (infra/contract.py)
    fabric: fab.TypeFabric | None = None  # the multi-node fabric its nodes get (infra/fabric.py)

    # -- the spec entry, by name ------------------------------------------------------
    @property
    def name(self) -> str:
        return self.group.name

    @property
    def cloud(self) -> str:
        return self.group.cloud

    @property
    def kind(self) -> str:
        return self.group.kind

    @property
    def workload(self) -> str:
        return self.group.workload

    @property
    def network(self) -> str:
        return self.group.network

    @property
    def market(self) -> Market:
        return self.group.market

    @property
    def scaling(self) -> Scaling:
        return self.group.scaling

    @property
    def schedule(self) -> list[ScheduleAction]:
        return self.group.schedule

    @property
    def path(self) -> str:
        return f"nodeGroups[{self.index}]"

    # -- derived ------------------------------------------------------------------------
    @property
    def spot(self) -> bool:
        return self.group.market.type == "spot"

    @property
    def gpus(self) -> int:
        return self.primary.gpu_count

    @property
    def nnodes(self) -> int:
        """Nodes one training run spans (the group's count at rest); 1 for inference."""
        return max(1, self.group.scaling.baseline) if self.workload == "training" else 1

    @property
    def max_nodes(self) -> int:
        """The most nodes one elastic run takes: every node a VM group may have; a Job's pods."""
        if self.workload != "training":
            return 1
        return max(1, self.group.scaling.max) if self.kind == "vm" else self.nnodes

    @property
    def min_nodes(self) -> int:
        """The fewest nodes an elastic run goes on with (a reclaim takes it down to them)."""
        return min(self.max_nodes, max(1, self.group.scaling.min))

    @property
    def bid_cap(self) -> float:
        """The most a spot node may cost, in the catalog row's currency: spotMaxPriceUsd, or the
        on-demand price where the spec gives no cap (clouds that need a cap get this one)."""
        return self.price_cap if self.price_cap is not None else self.primary.price_ondemand

    @property
    def checkpoint_url(self) -> str:
        return self.bucket.checkpoint_url(self.name)

    @property
    def node_hourly_usd(self) -> float:
        """What one running node of the group costs per hour, disk included, as the node reports
        it (the budget-pace alert sums it). A node of a spot group with an on-demand base cannot
        tell which it is, so it reports the on-demand price: the alert errs towards warning early."""
        p = self.prices
        node = {"reserved": p.reserved, "on-demand": p.on_demand}.get(self.market.type)
        if node is None:
            node = p.spot if self.market.on_demand_base == 0 else p.on_demand
        return node + p.disk

    def tags(self, base: dict[str, str]) -> dict[str, str]:
        """The stack's tags plus the group's identity, for the group's instances and disks."""
        return {**base, TAG_NODE_GROUP: self.name, TAG_WORKLOAD: self.workload}

    def labels(self) -> dict[str, str]:
        """Kubernetes node labels of the group's pools; Jobs select on the first."""
        market = "spot" if self.spot else "on-demand"
        return dict(zip(GROUP_LABELS, (self.name, self.primary.gpu_model, self.workload, market)))


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


def instance_types(spec: StackSpec, group: NodeGroup, catalog: cat.Catalog) -> tuple[str, ...]:
    """The group's instance types, preferred first: the named type or the selector's picks."""
    if group.instance_type is not None:
        types = [group.instance_type] + group.fallback_types
    else:
        region = spec.region_of(spec.network(group.network))
        picks = [c for c in cat.select(catalog, [group.cloud], requirement(spec, group), spec.pricing.cny_per_usd,
                                       region)
                 if group.kind != "vm" or not cat.vm_gpu_unsupported(group.cloud, c.type.gpu_model)]
        picked = [c.type.instance_type for c in picks[:4]]
        if picked and fab.wanted(group, picked[0]):  # one interface layout per launch configuration
            picked = fab.same_fabric(group.cloud, picked)
        types = picked + group.fallback_types
    return tuple(dict.fromkeys(types))


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
    types = instance_types(spec, group, catalog)
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
        bucket=bucket(spec, group.cloud), fabric=fab.wanted(group, types[0]))


@dataclass(frozen=True)
class Stack:
    """A valid spec with its node groups resolved. Built once, right after the spec is read."""

    spec: StackSpec
    groups: tuple[ResolvedGroup, ...]
    def group(self, name: str) -> ResolvedGroup:
        return next(g for g in self.groups if g.name == name)

    def of_cloud(self, cloud: str) -> list[ResolvedGroup]:
        return [g for g in self.groups if g.cloud == cloud]


def resolve(spec: StackSpec) -> Stack:
    catalog = spec.catalog()
    groups = (resolve_group(spec, g, i, catalog) for i, g in enumerate(spec.node_groups))
    return Stack(spec, tuple(replace(rg, trainer=trainer_env(spec, rg)) for rg in groups))
