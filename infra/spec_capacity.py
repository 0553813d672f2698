"""How a node group's nodes are bought (`market`) and where else it may run (`capacity`): the
spec models; their cross-field checks are infra/capacity/checks.py, the broker that moves a group
between candidates infra/capacity/broker.py (docs/capacity.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt

from infra.clouds import Cloud
from infra.spec_base import Amount, SpecModel

# Names as the clouds spell them (us-east-1, cn-hangzhou-h, ap-guangzhou-3, p5.48xlarge, ecs.gn7-c12g1.3xlarge,
# GN10Xp.2XLARGE40): letters, digits, dots and dashes; checked against regions.yaml and the catalog.
Place = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")]


class Market(SpecModel):
    """How the nodes are bought."""

    type: Literal["spot", "on-demand", "reserved"] = Field(description="Purchase market.")
    on_demand_base: StrictInt = Field(0, ge=0, description="With spot: nodes kept on-demand; the rest are spot.")
    spot_max_price_usd: Amount | None = Field(None, gt=0, description="With spot: price cap per node-hour; none = up to on-demand.")
    observed_mtbf_hours: Amount | None = Field(
        None, gt=0, description="Mean hours between the reclaims this group has actually seen; overrides the "
                                "estimate checkpointEvery: auto uses (infra/data/interruptions.yaml).")


class Candidate(SpecModel):
    """One more place a node group may run: another zone, region or cloud, with its types and
    market. What is left out is the group's own (on another cloud: that cloud's default region)."""

    cloud: Cloud | None = Field(None, description="Cloud; default: the group's.")
    region: Place | None = Field(None, description="Region; default: the group's (another cloud: that cloud's region).")
    zone: Place | None = Field(None, description="Zone the stock is asked for; the network must have a subnet there.")
    types: list[Place] = Field(default_factory=list, max_length=8,
                               description="Instance types, preferred first; default: the group's (same cloud only).")
    market: Market | None = Field(None, description="How the nodes are bought there; default: the group's market.")
