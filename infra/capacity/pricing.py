"""What each place of a group costs (docs/capacity.md): its nodes at the group's maximum size in
its market at its region's price (infra/data/prices.csv, overrides included), and what moving the
run there copies out of the bucket it runs from — the newest checkpoint and the dataset, at most
the bucket's expected size (storage.expectedGb) — at the source cloud's egress price
(infra/data/transfer_prices.yaml). The stack keeps one bucket per cloud, so a move within a cloud
copies nothing. The plan prints these rows; the policy pack caps them (capacity-candidates-capped)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from infra.capacity.places import Place, at, places
from infra.core import catalog as cat
from infra.model.spec import NodeGroup, StackSpec
from infra.resolve.groups import Stack, instance_types


@dataclass(frozen=True)
class PlacePrice:
    group: str
    index: int  # 0: as declared; k: capacity[k-1]
    place: str
    market: str
    on_demand_nodes: int  # nodes bought on-demand at the maximum size
    hourly_usd: float  # every node at the group's maximum size (spot at its expected price)
    worst_hourly_usd: float  # the same with spot at its cap, or at on-demand without one (the pack's cap)
    move_gb: float  # what a move there copies at most
    move_usd: float  # its egress
    estimate: bool  # a price in the row is an estimate


def node_prices(spec: StackSpec, cloud: str, itype: str, region: str) -> tuple[float, float, float, bool] | None:
    """(on-demand, spot, reserved) USD per node-hour of a type in a region, and whether estimated."""
    item = spec.catalog().priced(cloud, itype, region)
    if item is None:
        return None
    on_demand = cat.to_usd(item.price_ondemand, item.currency, spec.pricing.cny_per_usd)
    return (on_demand, on_demand * (1 - item.spot_discount), on_demand * (1 - item.reserved_discount),
            bool(item.price_estimate))


def egress_usd_per_gb(spec: StackSpec, source_cloud: str, target_cloud: str) -> float:
    if source_cloud == target_cloud:
        return 0.0
    row = cat.load_yaml("transfer_prices.yaml")[source_cloud]
    return cat.to_usd(float(row["internetPerGb"]), str(row["currency"]), spec.pricing.cny_per_usd)


def types_at(spec: StackSpec, group: NodeGroup, place: Place) -> tuple[str, ...]:
    """The place's types: its own, else what the group's GPU requirement picks there."""
    return place.types or instance_types(spec, at(spec, group, place.index), spec.catalog())


def price_place(spec: StackSpec, group: NodeGroup, place: Place, running_on: str) -> PlacePrice | None:
    """The place's row; None when its first type has no price there (the spec checks refuse that)."""
    types = types_at(spec, group, place)
    prices = node_prices(spec, place.cloud, types[0], place.region) if types else None
    if prices is None:
        return None
    on_demand, spot, reserved, estimate = prices
    market, most = place.market, group.scaling.max
    if market.spot:
        cap = market.spot_max_price_usd
        spot = min(spot, cap) if cap is not None else spot
        base = min(market.on_demand_base, most)
        hourly = base * on_demand + (most - base) * spot
        worst = base * on_demand + (most - base) * (min(cap, on_demand) if cap is not None else on_demand)
    else:
        base = most
        hourly = worst = most * (reserved if market.prepaid else on_demand)
    gb = float(spec.storage.expected_gb) if place.cloud != running_on else 0.0
    return PlacePrice(group.name, place.index, replace(place, types=tuple(types)).label, market.type, base if not market.prepaid else 0,
                      round(hourly, 4), round(worst, 4), gb, round(gb * egress_usd_per_gb(spec, running_on, place.cloud), 2),
                      estimate)


def place_prices(stack: Stack) -> list[PlacePrice]:
    """Every place of every group that has candidates, the declared place first."""
    spec = stack.declared or stack.spec
    out = []
    for group in spec.node_groups:
        if not group.capacity:
            continue
        running_on = stack.group(group.name).cloud
        out += [p for p in (price_place(spec, group, pl, running_on) for pl in places(spec, group)) if p is not None]
    return out


def pack_config(stack: Stack) -> list[dict[str, Any]]:
    """The rows as the policy pack reads them (capacityPlaces), each with its group's declared $/h."""
    rows = place_prices(stack)
    primary = {r.group: r.hourly_usd for r in rows if r.index == 0}
    return [{**asdict(r), "primaryHourlyUsd": primary.get(r.group, 0.0)} for r in rows]
