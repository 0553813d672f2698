"""A VM group's elasticity assurance on Alibaba Cloud (market.type: elasticity-assurance,
docs/capacity.md): ecs.ElasticityAssurance (pulumi-alicloud 4.0.0: instance_amount 1-1000,
instance_type — one type —, zone_ids — one zone —, period with period_unit Month 1-9 or Year
1-5, start_time, private_pool_options_match_criteria Open so that the ESS group's pay-as-you-go
instances of that type in that zone use it without naming it; Alibaba ECS docs "Elasticity
Assurance"; ROS ALIYUN::ECS::ElasticityAssurance). Nodes above reservedNodes are the overflow
market (spot) in the same ESS group.
"""

from __future__ import annotations

from datetime import timezone

import pulumi
import pulumi_alicloud as alicloud

from infra.capacity.reservations import assurance_period
from infra.resolve.groups import ResolvedGroup


def period(g: ResolvedGroup) -> tuple[int, str]:
    """The assurance's length as Alibaba sells it, exactly the window given: 1-9 calendar months or
    1-5 years (infra/capacity/reservations.py refuses any other window)."""
    market = g.market
    assert market.start is not None and market.end is not None  # the spec checks require both
    found = assurance_period(market.start, market.end)
    assert found is not None, "the spec checks refuse a window Alibaba cannot sell exactly"
    return found


def create(name: str, g: ResolvedGroup, zone: str, tags: dict[str, str],
           opts: pulumi.ResourceOptions) -> alicloud.ecs.ElasticityAssurance | None:
    market = g.market
    if not market.elasticity_assurance or market.start is None:
        return None
    length, unit = period(g)
    return alicloud.ecs.ElasticityAssurance(
        f"{name}-ea", instance_amount=market.reserved_of(g.scaling.max), instance_type=g.types[0],
        zone_ids=[zone], period=length, period_unit=unit,
        start_time=market.start.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        private_pool_options_match_criteria="Open",
        description=f"{g.name}: reserved GPU capacity (gpu-training-stack)",
        tags=tags, opts=opts)
