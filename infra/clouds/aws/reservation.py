"""A VM group's reservation market on AWS (docs/capacity.md):

- capacity-block: the EC2 Capacity Block for ML bought outside the stack (PurchaseCapacityBlock),
  by id. The launch template gets InstanceMarketOptions MarketType=capacity-block and a
  CapacityReservationSpecification targeting the block,
  which is how an Auto Scaling group consumes a Capacity Block ("a market type on your launch
  template alongside a Capacity Reservation target", EC2 Auto Scaling user guide, "Target
  Capacity Reservations from your Auto Scaling group"; EC2 API reference
  LaunchTemplateInstanceMarketOptionsRequest, CapacityReservationTarget).
- capacity-reservation: an On-Demand Capacity Reservation, the given one targeted by id, else one
  the stack creates (ec2.CapacityReservation, reservedNodes instances of the first type in the
  group's first zone, end_date_type limited at the market's end) that the template uses
  ("open": not targeted, so the group's other types and zones still launch; a targeted one
  needs a group of one type in one zone, infra/capacity/reservations.py). Nodes above reservedNodes: the overflow market (spot) in the same group.
The ASG's on-demand base is the reserved nodes (all of them without an overflow).
"""

from __future__ import annotations

from datetime import timezone

import pulumi
import pulumi_aws as aws

from infra.resolve.groups import ResolvedGroup


def market_options(g: ResolvedGroup) -> aws.ec2.LaunchTemplateInstanceMarketOptionsArgs | None:
    if not g.market.capacity_block:
        return None
    return aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(market_type="capacity-block")


def reservation_spec(g: ResolvedGroup, created: aws.ec2.CapacityReservation | None
                     ) -> aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs | None:
    """The template's capacity reservation: the group's reservation, or open ones (`reserved`)."""
    market = g.market
    target = market.reservation_id  # a created ODCR is used "open": the group's other types and zones still launch
    if market.targetable and target is not None:
        # one option at a time: the target alone (CloudFormation LaunchTemplate CapacityReservationSpecification)
        return aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
            capacity_reservation_target=aws.ec2.LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs(
                capacity_reservation_id=target))
    if market.prepaid or created is not None:
        return aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(capacity_reservation_preference="open")
    return None


def create(name: str, g: ResolvedGroup, zone: str, tags: dict[str, str],
           opts: pulumi.ResourceOptions) -> aws.ec2.CapacityReservation | None:
    """The On-Demand Capacity Reservation the stack holds for a `reserved` group (at its maximum)
    or a capacity-reservation group without an id (its reservedNodes, until its end)."""
    market = g.market
    if market.prepaid:
        return aws.ec2.CapacityReservation(f"{name}-odcr", instance_type=g.types[0], instance_platform="Linux/UNIX",
                                           availability_zone=zone, instance_count=g.fleet_max, tags=tags, opts=opts)
    if not market.capacity_reservation or market.reservation_id is not None:
        return None
    end = market.end.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if market.end else None
    return aws.ec2.CapacityReservation(f"{name}-odcr", instance_type=g.types[0], instance_platform="Linux/UNIX",
                                       availability_zone=zone, instance_count=market.reserved_of(g.scaling.max),
                                       end_date=end, end_date_type="limited" if end else "unlimited", tags=tags,
                                       opts=opts)


def on_demand_base(g: ResolvedGroup) -> tuple[int, int]:
    """(on-demand base, on-demand % above it) of the group's ASG."""
    market = g.market
    if market.spot:
        return market.on_demand_base, 0
    if market.bursts_to_spot:
        return market.reserved_of(g.scaling.max), 0
    return g.fleet_max, 100  # warm spares (scaling.spares) are on-demand nodes too
