"""Cost model: hourly and monthly cost per node group, per cloud and in total, in USD.

A node group's node count over a week follows its schedule (cron actions, UTC); the cost is
the integral of that count times the node price for its market. On-demand is always computed
alongside as the comparison. Reserved (prepaid) nodes are paid for around the clock at the
group's peak count, whatever the schedule does. CNY prices are converted at the stack's rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from croniter import croniter

from infra import rendezvous
from infra.capacity.pricing import place_prices
from infra.core import catalog as cat
from infra.model.spec import NodeGroup, StackSpec
from infra.resolve import fabric_plan, sharedfs, spares
from infra.resolve.groups import ResolvedGroup, Stack

WEEK = timedelta(days=7)
# A fixed Monday 00:00 UTC so that the figures are reproducible.
EPOCH = datetime(2026, 1, 5, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Occupancy:
    """Node-hours per week of a schedule, split at the on-demand base."""

    node_hours: float  # all nodes
    base_hours: float  # nodes within the on-demand base
    peak: int

    @property
    def average(self) -> float:
        return self.node_hours / (WEEK.total_seconds() / 3600)


def occupancy(group: NodeGroup) -> Occupancy:
    """Integrate the desired node count over one steady-state week of the schedule."""
    base = group.market.on_demand_base if group.market.spot else 0
    start, end = EPOCH, EPOCH + WEEK
    # Fire every action from a week before, so the count at `start` is the steady state.
    events: list[tuple[datetime, int]] = []
    for action in group.schedule:
        it = croniter(action.cron, start - WEEK)
        while (when := it.get_next(datetime)) < end:
            events.append((when, action.desired))
    events.sort(key=lambda e: e[0])
    count = group.scaling.baseline + group.scaling.spares  # spares run around the clock (no schedule)
    t = start - WEEK
    node_h = base_h = 0.0
    peak = 0
    for when, desired in events + [(end, -1)]:
        lo, hi = max(t, start), when
        if hi > lo:
            hours = (hi - lo).total_seconds() / 3600
            node_h += count * hours
            base_h += min(count, base) * hours
            peak = max(peak, count)
        if desired >= 0:
            count, t = desired, when
    return Occupancy(node_h, base_h, peak)


@dataclass(frozen=True)
class GroupCost:
    name: str
    cloud: str
    instance_type: str
    market: str
    average_nodes: float
    peak_nodes: int
    node_hourly_usd: float  # on-demand price of one node
    hourly_usd: float  # average over the month, market prices, incl. scratch disks
    monthly_usd: float
    peak_hourly_usd: float  # all peak nodes running at market prices
    on_demand_monthly_usd: float  # the same occupancy bought on-demand
    disk_monthly_usd: float
    price_estimate: bool
    region: str  # where the nodes run: the price is that region's (prices.csv)
    price_source: str
    price_date: str
    spot_max_price: float | None  # per node-hour in `currency`, what the cloud is sent
    currency: str  # the group's cloud bills in this (the catalog row's) currency
    spot_max_price_basis: str  # "spotMaxPriceUsd" | "on-demand price (no cap given)" | ""
    fabric: str = "none"  # efa | erdma | hcc | none (infra/fabric.py)
    fabric_interfaces: int = 0  # network interfaces declared per node for it
    fabric_devices: int = 0  # fabric devices each node must see
    fabric_gbps: int = 0
    placement: str = ""  # the group's placement resource (placement group, deployment set, HCC cluster)
    placement_monthly_usd: float = 0.0  # what it costs (all three: nothing)
    spares: int = 0  # warm spares (scaling.spares), counted in the figures above too
    spares_monthly_usd: float = 0.0  # what they cost, of monthly_usd
    losses_per_month: float = 0.0  # the run's expected member losses, the spares' use (infra/resolve/spares.py)
    reserved_total_usd: float = 0.0  # a reservation market: every reserved node-hour from start to end, used or not


def group_cost(rg: ResolvedGroup) -> GroupCost:
    group, itype, item = rg.group, rg.types[0], rg.primary
    prices = rg.prices
    on_demand, spot, reserved, disk_hourly = prices.on_demand, prices.spot, prices.reserved, prices.disk

    occ = occupancy(group)
    week_h = WEEK.total_seconds() / 3600
    if group.market.prepaid:
        spend_avg = occ.peak * reserved  # prepaid: paid every hour at the peak count
        nodes_avg = float(occ.peak)
        peak_hourly = occ.peak * reserved
    elif group.market.reservation:  # reserved node-hours are paid used or not, at the on-demand rate (an estimate
        # for a Capacity Block, priced per block when bought); an overflow market above them
        held, over = group.market.reserved_of(group.scaling.max), spot if group.market.overflow else on_demand
        spend_avg = held * on_demand + max(occ.average - held, 0.0) * over
        nodes_avg = max(occ.average, float(held))
        peak_hourly = held * on_demand + max(occ.peak - held, 0) * over
    elif group.market.on_demand:
        spend_avg = occ.average * on_demand
        nodes_avg = occ.average
        peak_hourly = occ.peak * on_demand
    else:
        base_avg = occ.base_hours / week_h
        spend_avg = base_avg * on_demand + (occ.average - base_avg) * spot
        nodes_avg = occ.average
        base_peak = min(occ.peak, group.market.on_demand_base)
        peak_hourly = base_peak * on_demand + (occ.peak - base_peak) * spot
    disk_avg = nodes_avg * disk_hourly
    hourly = spend_avg + disk_avg
    return GroupCost(
        name=group.name, cloud=group.cloud, instance_type=itype, market=group.market.type,
        average_nodes=round(nodes_avg, 4), peak_nodes=occ.peak,
        node_hourly_usd=round(on_demand, 4),
        hourly_usd=round(hourly, 4), monthly_usd=round(hourly * cat.HOURS_PER_MONTH, 2),
        peak_hourly_usd=round(peak_hourly + occ.peak * disk_hourly, 4),
        on_demand_monthly_usd=round((occ.average * (on_demand + disk_hourly)) * cat.HOURS_PER_MONTH, 2),
        disk_monthly_usd=round(disk_avg * cat.HOURS_PER_MONTH, 2),
        price_estimate=item.price_estimate, region=rg.region, price_source=item.price_source,
        price_date=item.price_date,
        spot_max_price=round(rg.bid_cap, 4) if rg.spot else None, currency=item.currency,
        spot_max_price_basis=("" if not rg.spot else "spotMaxPriceUsd" if rg.price_cap is not None
                              else "on-demand price (no cap given)"),
        **fabric_plan.summary(rg), **_spares(rg), reserved_total_usd=reserved_total_usd(rg),
    )


def _spares(rg: ResolvedGroup) -> dict[str, Any]:
    if not rg.group.scaling.spares:
        return {}
    f = spares.figures(rg)
    return {"spares": f.spares, "spares_monthly_usd": f.monthly_usd, "losses_per_month": f.losses_per_month}


def reserved_total_usd(rg: ResolvedGroup) -> float:
    """A reservation market's whole price: every reserved node-hour from start to end, used or not."""
    market = rg.market
    if not market.reservation or market.start is None or market.end is None:
        return 0.0
    hours = (market.end - market.start).total_seconds() / 3600
    return round(market.reserved_of(rg.scaling.max) * hours * rg.prices.on_demand, 2)


def storage_monthly_usd(spec: StackSpec, cloud: str) -> float:
    prices = cat.load_storage_prices()[cloud]
    monthly = spec.storage.expected_gb * float(prices["objectStorage"])
    return round(cat.to_usd(monthly, str(prices["currency"]), spec.pricing.cny_per_usd), 2)


def clusters_hourly_usd(stack: Stack, cloud: str) -> float:
    """What the cloud's managed clusters cost around the clock besides their GPU pools: the
    control plane and the untainted system pool of each (data/system_pools.yaml)."""
    clusters = len({g.network for g in stack.of_cloud(cloud) if g.kind == "kubernetes"})
    pool = cat.load_system_pools()[cloud]
    each = float(pool["controlPlaneHourly"]) + int(pool["nodes"]) * float(pool["nodeHourly"])
    return clusters * cat.to_usd(each, str(pool["currency"]), stack.spec.pricing.cny_per_usd)


def nat_hourly_usd(spec: StackSpec, cloud: str) -> float:
    """The cloud's NAT gateways and their public addresses (data processed not counted)."""
    prices = cat.load_network_prices()[cloud]
    each = float(prices["natHourly"]) + float(prices["publicIpHourly"])
    gateways = sum(1 for n in spec.networks if n.cloud == cloud and n.nat)
    return gateways * cat.to_usd(each, str(prices["currency"]), spec.pricing.cny_per_usd)


def registry_monthly_usd(spec: StackSpec, cloud: str) -> float:
    """The registry the stack builds the trainer image into (infra/image.py): none where the
    cloud has no nodes or the spec names a prebuilt image for it."""
    if cloud in spec.training.prebuilt_images or not any(g.cloud == cloud for g in spec.node_groups):
        return 0.0
    prices = cat.load_registry_prices()[cloud]
    monthly = float(prices["monthly"]) + float(prices["storageGbMonth"]) * float(prices["imageGb"])
    return round(cat.to_usd(monthly, str(prices["currency"]), spec.pricing.cny_per_usd), 2)


def rendezvous_monthly_usd(stack: Stack, cloud: str, placed: Sequence[rendezvous.Site]) -> float:
    """The rendezvous store instances of the cloud's multi-node VM runs among the stack's stores
    (`placed`: infra/rendezvous.py sites, placed once by the caller)."""
    stores = [s for s in placed if s.cloud == cloud]
    if not stores:
        return 0.0
    prices = cat.load_rendezvous()[cloud]
    hourly = cat.to_usd(float(prices["hourly"]), str(prices["currency"]), stack.spec.pricing.cny_per_usd)
    return round(len(stores) * hourly * cat.HOURS_PER_MONTH, 2)


def stack_cost(stack: Stack) -> dict[str, Any]:
    """The cost summary the plan prints and the policy pack checks."""
    spec = stack.spec
    groups = [group_cost(g) for g in stack.groups]
    by_cloud: dict[str, dict[str, float]] = {}
    placed = rendezvous.sites(spec, stack.groups)
    for cloud in spec.clouds:
        mine = [g for g in groups if g.cloud == cloud]
        storage = storage_monthly_usd(spec, cloud)
        clusters = round(clusters_hourly_usd(stack, cloud) * cat.HOURS_PER_MONTH, 2)
        nat = round(nat_hourly_usd(spec, cloud) * cat.HOURS_PER_MONTH, 2)
        registry = registry_monthly_usd(spec, cloud)
        stores = rendezvous_monthly_usd(stack, cloud, placed)
        shared = round(sharedfs.monthly_usd(spec, cloud), 2)
        placement = round(sum(g.placement_monthly_usd for g in mine), 2)
        fixed = storage + clusters + nat + registry + stores + shared + placement
        monthly = sum(g.monthly_usd for g in mine) + fixed
        by_cloud[cloud] = {
            "hourly_usd": round(monthly / cat.HOURS_PER_MONTH, 4),
            "monthly_usd": round(monthly, 2),
            "peak_hourly_usd": round(sum(g.peak_hourly_usd for g in mine) + fixed / cat.HOURS_PER_MONTH, 4),
            "on_demand_monthly_usd": round(sum(g.on_demand_monthly_usd for g in mine) + fixed, 2),
            "storage_monthly_usd": storage,
            "clusters_monthly_usd": clusters,
            "nat_monthly_usd": nat,
            "registry_monthly_usd": registry,
            "rendezvous_monthly_usd": stores,
            "shared_fs_monthly_usd": shared,
            "placement_monthly_usd": placement,  # placement groups, deployment sets, HCC clusters
        }
    monthly = sum(c["monthly_usd"] for c in by_cloud.values())
    on_demand = sum(c["on_demand_monthly_usd"] for c in by_cloud.values())
    return {
        "currency": "USD",
        "cny_per_usd": spec.pricing.cny_per_usd,
        "hourly_usd": round(monthly / cat.HOURS_PER_MONTH, 4),
        "monthly_usd": round(monthly, 2),
        "peak_hourly_usd": round(sum(c["peak_hourly_usd"] for c in by_cloud.values()), 4),
        "on_demand_monthly_usd": round(on_demand, 2),
        "savings_vs_on_demand_pct": round(100 * (1 - monthly / on_demand), 1) if on_demand else 0.0,
        "budget_monthly_usd": spec.budget.monthly_limit_usd,
        "includes_estimates": any(g.price_estimate for g in groups),
        "by_cloud": by_cloud,
        "node_groups": [asdict(g) for g in groups],
        # each group's places, as declared then its capacity candidates, at the maximum size (docs/capacity.md)
        "capacity_places": [asdict(p) for p in place_prices(stack)],
    }
