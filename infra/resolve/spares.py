"""Warm spares (nodeGroups[].scaling.spares: k): k nodes beyond the run's world that boot, pass
the GPU gate and the fabric check, pull the image and wait outside the run until a member is
lost (training/node/rdzv_launch.py says how torch's rendezvous holds them). A VM group's scaling
group holds the run's nodes plus k (ResolvedGroup.fleet_min / fleet_max / fleet_desired, all
max + k) while its world stays scaling.max (NNODES); a Kubernetes group's Job gets one more pod per spare
(ResolvedGroup.job_pods), which its pool must have room for. Here: where spares can work (the
checks), and what they cost against the failures they are for (the plan's cost and the policy
pack's spare cap).

Spares wait in torchrun's elastic rendezvous: a multi-node training group (such runs are
torchrun's already: infra/checks/cloud_rules.py). A VM group's world must be full (desired = max) and
its nodes replaced by a scaling group. Anywhere else the key is refused with the reason."""

from __future__ import annotations

from dataclasses import dataclass

from infra.contract import interruptions
from infra.core import catalog as cat
from infra.core.errors import Problem
from infra.resolve.resolved import ResolvedGroup


def problems(rg: ResolvedGroup) -> list[Problem]:
    """Why the group cannot have the spares it asks for (none when it asks for none)."""
    s = rg.group.scaling
    if not s.spares:
        return []
    key, k = f"{rg.path}.scaling.spares", s.spares
    if k > s.max:  # a typo (40 for 4) would otherwise buy a fleet of idle nodes
        return [Problem(key, f"{k}: more warm spares than the run has nodes (scaling.max {s.max}); "
                             f"set at most {s.max}")]
    if rg.workload != "training" or rg.max_nodes <= 1:
        why = ("only a multi-node training run (scaling.max above 1; a Kubernetes group's desired nodes above 1) "
               "has a world for a spare to wait outside of")
    elif rg.kind == "kubernetes":
        if rg.job_pods <= s.max:
            return []
        why = (f"the pool holds at most {s.max} nodes (scaling.max) and the Job asks for {rg.nnodes} + {k} pods, "
               f"one node each; raise scaling.max to {rg.job_pods}")
    elif s.baseline != s.max:
        why = (f"the run's world is not full (desired {s.baseline} < max {s.max}): a node it can still take joins "
               f"it as a member, not as a spare; set scaling.desired to {s.max}")
    elif rg.group.schedule:
        why = "a schedule changes the group's size; spares wait beside a world of fixed size: drop one or the other"
    elif rg.market.capacity_block:
        why = ("a Capacity Block's launch template buys only from the block, which holds the run's nodes "
               "(scaling.max): a spare above it could never launch")
    elif _fixed(rg):
        why = ("the group's nodes are fixed instances (reserved on Alibaba or Tencent, or a Tencent HCC group): "
               "no scaling group replaces a lost one or refills the spares")
    else:
        return []
    return [Problem(key, f"{k}: {why}; or set 0")]


def _fixed(rg: ResolvedGroup) -> bool:
    from infra.clouds import fixed_instances  # the cloud packages import this module's callers

    return fixed_instances(rg) >= rg.group.scaling.max


@dataclass(frozen=True)
class SpareFigures:
    """What a group's spares cost and what they are for, per month (USD)."""

    spares: int
    world: int  # the run's nodes (NNODES)
    spare_hourly_usd: float  # one spare node, disk included, in the group's market
    monthly_usd: float  # all the group's spares around the clock
    losses_per_month: float  # expected member losses of the run (infra/data/interruptions.yaml)

    @property
    def usd_per_loss(self) -> float:
        """What the spares cost per member loss they cover."""
        return self.monthly_usd / self.losses_per_month if self.losses_per_month else 0.0


def figures(rg: ResolvedGroup) -> SpareFigures:
    """The spares' price in the group's market and the run's expected losses: nodes x hours a
    month / the node's mean time between interruptions (infra/contract.py interruptions). A spot
    group's spares are spot (its on-demand base is the run's, at most scaling.max); a reservation
    holds at most the run's nodes, so its spares are above it: in its overflow market (spot), else
    on-demand (an open ODCR's or an assurance's nodes beyond it are plain on-demand)."""
    p, market = rg.prices, rg.market
    if market.prepaid:
        node = p.reserved
    elif market.reservation:
        node = p.spot if market.bursts_to_spot else p.on_demand
    else:
        node = p.on_demand if market.on_demand else p.spot
    node += p.disk
    k = rg.group.scaling.spares
    run_mtbf_s, _ = interruptions(rg)
    losses = cat.HOURS_PER_MONTH * 3600 / run_mtbf_s if rg.workload == "training" else 0.0
    return SpareFigures(spares=k, world=rg.max_nodes, spare_hourly_usd=round(node, 4),
                        monthly_usd=round(k * node * cat.HOURS_PER_MONTH, 2), losses_per_month=round(losses, 2))
