"""A node group resolved (instance types, hardware, disks, prices, price cap, bucket, trainer
contract, fabric) and the stack of them: the types alone, below everything that computes or
consumes them (infra/resolve/groups.py resolves them once; infra/contract.py, infra/rendezvous.py and
the components read them). Importable from infra.resolve.groups as well."""

from __future__ import annotations

from dataclasses import dataclass, field

from infra import fabric as fab
from infra.buckets import Bucket
from infra.core import catalog as cat
from infra.model.spec import Market, NodeGroup, ScheduleAction, Scaling, StackSpec
from infra.teams.registry import Registry

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
        return self.group.market.spot

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

    # The group's autoscaling capacity: the run's nodes plus its warm spares (scaling.spares),
    # which boot, pass the gate and wait outside the run (training/node/rdzv_launch.py).
    @property
    def fleet_min(self) -> int:
        # With spares the world is full and fixed (desired = max, infra/resolve/spares.py), so the minimum
        # is the whole fleet: each cloud's group ignores later changes of its desired capacity
        # (the cloud's scaling moves it), and spares added to a running stack come from the raised
        # minimum, which the group fills by itself.
        s = self.group.scaling
        return s.max + s.spares if s.spares else s.min

    @property
    def fleet_max(self) -> int:
        return self.group.scaling.max + self.group.scaling.spares

    @property
    def fleet_desired(self) -> int:
        return self.group.scaling.baseline + self.group.scaling.spares

    @property
    def job_pods(self) -> int:
        """A Kubernetes group's Job: one pod per node of the run, and one per warm spare."""
        return self.nnodes + self.group.scaling.spares

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
        p, m = self.prices, self.market
        if m.prepaid:
            node = p.reserved
        elif m.on_demand or m.reservation:  # reserved hours are paid at the on-demand rate (infra/resolve/cost.py)
            node = p.on_demand
        else:
            node = p.spot if m.on_demand_base == 0 else p.on_demand
        return node + p.disk

    def tags(self, base: dict[str, str]) -> dict[str, str]:
        """The stack's tags plus the group's identity, for the group's instances and disks."""
        return {**base, TAG_NODE_GROUP: self.name, TAG_WORKLOAD: self.workload}

    def labels(self) -> dict[str, str]:
        """Kubernetes node labels of the group's pools; Jobs select on the first."""
        market = "spot" if self.spot else "on-demand"
        return dict(zip(GROUP_LABELS, (self.name, self.primary.gpu_model, self.workload, market)))


@dataclass(frozen=True)
class Stack:
    """A valid spec with its node groups resolved. Built once, right after the spec is read."""

    spec: StackSpec
    groups: tuple[ResolvedGroup, ...]
    # The team registry kubernetes.queues names, read once at the edge (infra/stack/stackfile.py
    # teams_reader) and checked; None for a stack without queues.
    teams: Registry | None = field(default=None, compare=False)
    # The spec as declared, before each group was placed at its activeCandidate (infra/capacity/places.py):
    # where the candidates are read from; None = `spec`.
    declared: StackSpec | None = field(default=None, compare=False)

    def group(self, name: str) -> ResolvedGroup:
        return next(g for g in self.groups if g.name == name)

    def of_cloud(self, cloud: str) -> list[ResolvedGroup]:
        return [g for g in self.groups if g.cloud == cloud]
