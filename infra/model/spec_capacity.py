"""How a node group's nodes are bought (`market`) and where else it may run (`capacity`): the
spec models; their cross-field checks are infra/capacity/checks.py, the broker that moves a group
between candidates infra/capacity/broker.py (docs/capacity.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field, StrictInt

from infra.clouds import Cloud
from infra.model.spec_base import Amount, SpecModel

# Names as the clouds spell them (us-east-1, cn-hangzhou-h, ap-guangzhou-3, p5.48xlarge, ecs.gn7-c12g1.3xlarge,
# GN10Xp.2XLARGE40): letters, digits, dots and dashes; checked against regions.yaml and the catalog.
Place = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")]


# Capacity bought for a time, as a market (docs/capacity.md): an EC2 Capacity Block for ML, an EC2
# On-Demand Capacity Reservation, an Alibaba ECS elasticity assurance. Which cloud sells which is
# data (infra/data/capabilities.yaml markets); the checks are infra/capacity/reservations.py.
RESERVATIONS = ("capacity-block", "capacity-reservation", "elasticity-assurance")


class Market(SpecModel):
    """How the nodes are bought."""

    type: Literal["spot", "on-demand", "reserved", "capacity-block", "capacity-reservation", "elasticity-assurance"] = \
        Field(description="Purchase market: spot, on-demand, reserved (prepaid), or capacity bought for a time "
                          "(capacity-block, capacity-reservation, elasticity-assurance: with start and end).")
    on_demand_base: StrictInt = Field(0, ge=0, description="With spot: nodes kept on-demand; the rest are spot.")
    spot_max_price_usd: Amount | None = Field(None, gt=0, description="With spot: price cap per node-hour; none = up to on-demand.")
    observed_mtbf_hours: Amount | None = Field(
        None, gt=0, description="Mean hours between the reclaims this group has actually seen; overrides the "
                                "estimate checkpointEvery: auto uses (infra/data/interruptions.yaml).")
    start: AwareDatetime | None = Field(None, description="Reservation markets: when the reserved capacity starts "
                                                          "(ISO 8601 with its offset).")
    end: AwareDatetime | None = Field(None, description="Reservation markets: when it ends; the trainer stops with "
                                                        "a checkpoint in the bucket before the cloud takes the nodes.")
    reservation_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")] | None = Field(
        None, description="capacity-block: the purchased block's id (cr-...; bought outside the stack). "
                          "capacity-reservation: an existing reservation to target; none: the stack creates one.")
    reserved_nodes: StrictInt | None = Field(None, ge=1, description="Reservation markets: nodes reserved; default "
                                                                     "scaling.max.")
    overflow: Literal["spot"] | None = Field(None, description="Reservation markets: nodes above reservedNodes are "
                                                               "bought in this market (a reserved baseline that bursts).")

    # The questions the code asks of a market, answered here only: no other module compares
    # market.type with a market's name (tests/test_market_questions.py holds it).
    @property
    def spot(self) -> bool:
        """Spot nodes (above onDemandBase): reclaimed with a notice, bid up to a cap."""
        return self.type == "spot"

    @property
    def on_demand(self) -> bool:
        """Plain on-demand nodes, paid by the hour while they run."""
        return self.type == "on-demand"

    @property
    def prepaid(self) -> bool:
        """`reserved`: prepaid (subscription) nodes, paid every hour at the group's peak."""
        return self.type == "reserved"

    @property
    def reservation(self) -> bool:
        """Capacity bought for a time (RESERVATIONS): its reserved hours are billed, used or not."""
        return self.type in RESERVATIONS

    @property
    def capacity_block(self) -> bool:
        return self.type == "capacity-block"

    @property
    def capacity_reservation(self) -> bool:
        return self.type == "capacity-reservation"

    @property
    def elasticity_assurance(self) -> bool:
        return self.type == "elasticity-assurance"

    @property
    def targetable(self) -> bool:
        """A reservation a launch template can target by its id (a Capacity Block, an ODCR)."""
        return self.capacity_block or self.capacity_reservation

    @property
    def bursts_to_spot(self) -> bool:
        """A reservation whose nodes above reservedNodes are spot (overflow: spot)."""
        return self.reservation and self.overflow == "spot"

    def reserved_of(self, most: int) -> int:
        """Nodes the reservation holds, of a group of at most `most`."""
        return min(self.reserved_nodes or most, most) if self.reservation else 0


class Candidate(SpecModel):
    """One more place a node group may run: another zone, region or cloud, with its types and
    market. What is left out is the group's own (on another cloud: that cloud's default region)."""

    cloud: Cloud | None = Field(None, description="Cloud; default: the group's.")
    region: Place | None = Field(None, description="Region; default: the group's (another cloud: that cloud's region).")
    zone: Place | None = Field(None, description="Zone the stock is asked for; the network must have a subnet there.")
    types: list[Place] = Field(default_factory=list, max_length=8,
                               description="Instance types, preferred first; default: the group's (same cloud only).")
    market: Market | None = Field(None, description="How the nodes are bought there; default: the group's market.")
