"""A VM group's elasticity assurance on Alibaba Cloud (market.type: elasticity-assurance,
docs/capacity.md): ecs.ElasticityAssurance (pulumi-alicloud 4.0.0: instance_amount 1-1000,
instance_type — one type —, zone_ids — one zone —, period with period_unit Month 1-9 or Year
1-5, start_time, private_pool_options_match_criteria Open so that the ESS group's pay-as-you-go
instances of that type in that zone use it without naming it; Alibaba ECS docs "Elasticity
Assurance"; ROS ALIYUN::ECS::ElasticityAssurance). Nodes above reservedNodes are the overflow
market (spot) in the same ESS group.
"""

from __future__ import annotations

import math
from datetime import timezone

import pulumi
import pulumi_alicloud as alicloud

from infra.groups import ResolvedGroup


def bursts(g: ResolvedGroup) -> bool:
    """A reserved baseline whose nodes above it are spot."""
    return g.market.reservation and g.market.overflow == "spot"


def period(g: ResolvedGroup) -> tuple[int, str]:
    """The assurance's length as Alibaba sells it: months up to 9, else whole years (rounded up)."""
    market = g.market
    assert market.start is not None and market.end is not None  # the spec checks require both
    months = max(1, math.ceil((market.end - market.start).days / 30))
    return (months, "Month") if months <= 9 else (min(5, math.ceil(months / 12)), "Year")


def create(name: str, g: ResolvedGroup, zone: str, tags: dict[str, str],
           opts: pulumi.ResourceOptions) -> alicloud.ecs.ElasticityAssurance | None:
    market = g.market
    if market.type != "elasticity-assurance" or market.start is None:
        return None
    length, unit = period(g)
    return alicloud.ecs.ElasticityAssurance(
        f"{name}-ea", instance_amount=market.reserved_of(g.scaling.max), instance_type=g.types[0],
        zone_ids=[zone], period=length, period_unit=unit,
        start_time=market.start.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        private_pool_options_match_criteria="Open",
        description=f"{g.name}: reserved GPU capacity (gpu-training-stack)",
        tags=tags, opts=opts)
