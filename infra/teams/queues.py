"""The queues of a shared stack's clusters, as data: one Kueue ResourceFlavor per GPU model and
market of the cluster's training pools, one ClusterQueue per shared team (its registry quota,
in GPUs, split into on-demand and spot) and one for the stack's own Jobs, all in one cohort per
cluster. The Kubernetes objects (infra/k8s/queues.py) and `make teams` both read this, and
`check` refuses quotas the pools cannot hold: a quota that holds is one the nodes can serve.

A team's on-demand share is at most `markets.onDemandBaseMax` nodes of its GPUs; the rest of its
quota is spot. cpu and memory quotas follow the GPUs: a node's pod share per node's worth of GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from infra.clouds import profile
from infra.core.errors import Problem
from infra.model.pools import pool_parts
from infra.model.spec import quota_of
from infra.pods import NAMESPACE, pod_resources
from infra.resolve.groups import ResolvedGroup, Stack
from infra.teams.registry import Registry, Team

OWN_QUEUE = "training"  # the LocalQueue of the stack's own Jobs, in the training namespace
GPU = "nvidia.com/gpu"


@dataclass
class Flavor:
    """Nodes of one GPU model bought one way on one cluster."""

    name: str  # e.g. aws-h100-spot (unique across clusters: the showback prices usage by flavor)
    model: str
    market: str  # spot | on-demand
    gpus_per_node: int
    cpu_per_node: int  # the pod's share of a node (infra/pods.py pod_resources)
    memory_gib_per_node: int
    gpu_hourly_usd: float  # per GPU-hour, for showback at full quota
    capacity_gpus: int = 0  # all the flavor's pools at their max
    pools: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Queue:
    """A ClusterQueue: who, which namespace, cohort borrowing, GPUs per flavor."""

    name: str
    team: str
    namespace: str
    local_queue: str
    borrowing: bool
    gpus: dict[str, int]  # flavor -> nominal GPUs
    registry_path: str  # where the quota comes from, for messages

    def resources(self, flavor: Flavor) -> dict[str, int]:
        """Nominal quota of each covered resource on `flavor` (cpu cores, memory GiB, GPUs)."""
        nodes = math.ceil(self.gpus[flavor.name] / flavor.gpus_per_node)
        return {"cpu": nodes * flavor.cpu_per_node, "memory": nodes * flavor.memory_gib_per_node,
                GPU: self.gpus[flavor.name]}


def _part_markets(rg: ResolvedGroup) -> list[tuple[str, int]]:
    """(market, most nodes) of each of a group's pools: EKS and TKE split a spot group's on-demand
    base into a pool of its own; an ACK pool mixes them and carries its group's market."""
    if profile(rg.cloud).kubernetes_pool_mixes_markets:
        return [("spot" if rg.spot else "on-demand", rg.scaling.max)]
    return [("spot" if p.spot else "on-demand", p.max) for p in pool_parts(rg.group)]


def training_pools(stack: Stack, cloud: str) -> list[ResolvedGroup]:
    return [g for g in stack.of_cloud(cloud) if g.kind == "kubernetes" and g.workload == "training"]


def flavor_name(cloud: str, model: str, market: str) -> str:
    return f"{cloud}-{model.lower()}-{market}"


def flavors(stack: Stack, cloud: str) -> dict[str, Flavor]:
    out: dict[str, Flavor] = {}
    for rg in training_pools(stack, cloud):
        resources, _ = pod_resources(rg)
        for market, most in _part_markets(rg):
            name = flavor_name(cloud, rg.primary.gpu_model, market)
            hourly = rg.prices.spot if market == "spot" else rg.prices.on_demand
            flavor = out.setdefault(name, Flavor(
                name, rg.primary.gpu_model, market, rg.gpus, int(resources["cpu"]),
                int(resources["memory"].removesuffix("Gi")), round((hourly + rg.prices.disk) / rg.gpus, 4)))
            flavor.capacity_gpus += most * rg.gpus
            flavor.pools.append(f"{rg.name} {market} {most} x {rg.gpus}")
    return out


def team_queue(team: Team, index: int, cloud: str, available: dict[str, Flavor]) -> Queue:
    gpus: dict[str, int] = {}
    for model, quota in sorted(quota_of(team.gpus, cloud).items()):
        od, spot = flavor_name(cloud, model, "on-demand"), flavor_name(cloud, model, "spot")
        per_node = (available.get(od) or available.get(spot) or Flavor("", model, "", 1, 0, 0, 0)).gpus_per_node
        on_demand = min(quota, team.markets.on_demand_base_max * per_node) if od in available else 0
        if on_demand:
            gpus[od] = on_demand
        if quota - on_demand:
            gpus[spot] = quota - on_demand
    return Queue(f"team-{team.name}", team.name, f"team-{team.name}", team.name, team.borrowing, gpus,
                 f"teams[{index}].gpus.{cloud}")


def own_queue(stack: Stack, cloud: str) -> Queue:
    """The stack's own training Jobs: each may be admitted on any flavor of its group's pools,
    so the queue holds one Job's worth on each (never borrowing)."""
    gpus: dict[str, int] = {}
    for rg in training_pools(stack, cloud):
        for market, _ in _part_markets(rg):
            name = flavor_name(cloud, rg.primary.gpu_model, market)
            gpus[name] = gpus.get(name, 0) + rg.job_pods * rg.gpus
    return Queue(f"stack-{stack.spec.env}", stack.spec.team_name, NAMESPACE, OWN_QUEUE, False, gpus,
                 "nodeGroups (this stack's Jobs)")


def queues(stack: Stack, registry: Registry, cloud: str) -> list[Queue]:
    """Every ClusterQueue of the stack's cluster on `cloud`: the stack's own, then the teams'
    (a team whose quota finds no flavor here gets none: Kueue requires at least one)."""
    available = flavors(stack, cloud)
    if not available:
        return []
    teams = [team_queue(t, registry.index(t.name), cloud, available) for t in registry.shared if cloud in t.gpus]
    return [own_queue(stack, cloud), *(q for q in teams if q.gpus)]


def check(stack: Stack, registry: Registry) -> Iterator[Problem]:
    """Every shared team's GPUs have pools of their model here, and every flavor's quotas together
    fit its pools at their max size."""
    spec = stack.spec
    yield from _one_cluster_per_cloud(stack)
    for team in registry.shared:
        i = registry.index(team.name)
        for cloud, quota in team.gpus.items():
            if cloud not in spec.clouds:
                yield Problem(f"teams[{i}].gpus.{cloud}", f"the shared stack does not use {cloud}; remove the quota "
                                                          "or add the cloud and a Kubernetes training pool there")
                continue
            where = sorted({g.region for g in training_pools(stack, cloud)})
            if where and not set(where) & set(team.regions.get(cloud, [])):
                yield Problem(f"teams[{i}].regions.{cloud}", f"the shared {cloud} cluster is in {', '.join(where)}, "
                                                             f"not in team {team.name}'s regions; add it there")
            here = flavors(stack, cloud)
            for model in quota:
                if not any(f.model == model for f in here.values()):
                    models = sorted({f.model for f in here.values()}) or ["none"]
                    yield Problem(f"teams[{i}].gpus.{cloud}.{model}",
                                  f"no Kubernetes training pool on {cloud} has {model} (pools here: "
                                  f"{', '.join(models)}); ask for a model the shared clusters have")
    for cloud in spec.clouds:
        yield from _fits(stack, registry, cloud)


def _one_cluster_per_cloud(stack: Stack) -> Iterator[Problem]:
    """A team's quota on a cloud is one ClusterQueue on one cluster: the shared stack keeps its
    Kubernetes training pools in one network (one cluster, one region) per cloud."""
    for cloud in stack.spec.clouds:
        networks = sorted({g.network for g in training_pools(stack, cloud)})
        if len(networks) > 1:
            yield Problem("nodeGroups", f"the shared stack's {cloud} training pools are in {len(networks)} clusters "
                                        f"({', '.join(networks)}); teams queue on one cluster per cloud: keep the "
                                        "Kubernetes training pools of a cloud in one network")


def _fits(stack: Stack, registry: Registry, cloud: str) -> Iterator[Problem]:
    here = flavors(stack, cloud)
    planned = queues(stack, registry, cloud)
    for name, flavor in sorted(here.items()):
        asked = [(q, q.gpus[name]) for q in planned if q.gpus.get(name)]
        total = sum(n for _, n in asked)
        if total > flavor.capacity_gpus:
            who = ", ".join(f"{q.name} {n} ({q.registry_path})" for q, n in asked)
            fix = ("lower the teams' markets.onDemandBaseMax (a team's on-demand share is that many nodes' GPUs; "
                   "this stack's own Jobs keep theirs) or raise the pools' on-demand base"
                   if flavor.market == "on-demand" else "lower the teams' quotas or raise the pools' scaling.max")
            yield Problem(f"{cloud}.{name}", f"the queues' quotas add up to {total} GPUs ({who}), over the "
                                             f"{flavor.capacity_gpus} its pools hold at their max "
                                             f"({'; '.join(flavor.pools)}); {fix}")
