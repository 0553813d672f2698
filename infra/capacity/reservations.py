"""The rules for reservation markets (`market.type: capacity-block | capacity-reservation |
elasticity-assurance`, docs/capacity.md), each a one-line problem naming the key: start and end
given, in order, and within what the cloud sells (EC2 Capacity Blocks: 1 to 182 days; Alibaba
elasticity assurance: 1 month to 5 years — infra/data/reservations.yaml, with sources); a
Capacity Block's id; reservedNodes within scaling.max; an overflow market only above a reserved
baseline; and the reservation fields only with a reservation market. Which cloud sells which
market is data (infra/data/capabilities.yaml markets), checked with every market."""

from __future__ import annotations

import os
from datetime import datetime, time, timedelta, timezone

from infra.core import catalog as cat
from infra.core.clock import judged_on
from infra.core.errors import Problem
from infra.model.spec import Market, NodeGroup, StackSpec


def now() -> datetime:
    """The one clock the reservation checks and the broker's windows read: midnight UTC of
    GTS_TODAY when it is set (the plan's pinned date, infra/prices/age.py: a reproducible plan, the
    tests), else the system's time in UTC."""
    if os.environ.get("GTS_TODAY"):
        return datetime.combine(judged_on(), time(0), tzinfo=timezone.utc)
    return datetime.now(timezone.utc)


def open_now(market: Market, cloud: str, at: datetime) -> bool:
    """Whether a reservation market's window [start, end - the cloud's notice) holds `at` (any other
    market: always)."""
    if not market.reservation or market.start is None or market.end is None:
        return True
    return market.start <= at < market.end - timedelta(seconds=notice_s(cloud, market.type))


def add_months(when: datetime, months: int) -> datetime | None:
    """`when` that many calendar months on (None when that day does not exist: Jan 31 + 1)."""
    year, month = divmod(when.month - 1 + months, 12)
    try:
        return when.replace(year=when.year + year, month=month + 1)
    except ValueError:
        return None


def whole_months(start: datetime, end: datetime) -> int | None:
    """The calendar months from start to end when end is exactly that many months on, else None."""
    start = start.astimezone(timezone.utc)
    months = (end.astimezone(timezone.utc).year - start.year) * 12 + end.astimezone(timezone.utc).month - start.month
    return next((m for m in (months, months - 1) if m >= 1 and add_months(start, m) == end), None)


def assurance_period(start: datetime, end: datetime) -> tuple[int, str] | None:
    """The elasticity assurance Alibaba sells for exactly [start, end): (1-9, Month) or (1-5, Year)."""
    months = whole_months(start, end)
    if months is not None and months <= 9:
        return months, "Month"
    if months is not None and months % 12 == 0 and months <= 60:
        return months // 12, "Year"
    return None


def _bought(market: Market, path: str) -> list[Problem]:
    """What the cloud sells for exactly the window given: an elasticity assurance in whole months
    or years; a stack-created ODCR (no start date: it exists, and is billed, from `up`) from now."""
    assert market.start is not None and market.end is not None
    if market.elasticity_assurance and assurance_period(market.start, market.end) is None:
        return [Problem(f"{path}.end", f"an elasticity assurance is sold for 1 to 9 whole months or 1 to 5 whole "
                                       f"years from its start: {market.start.isoformat()} to {market.end.isoformat()} "
                                       "is neither; give an end that many calendar months after start")]
    if market.capacity_reservation and market.reservation_id is None and market.start > now():
        return [Problem(f"{path}.start", f"{market.start.isoformat()} is after now: EC2 has no start date for an "
                                         "On-Demand Capacity Reservation; the stack creates it (and it is billed) when "
                                         "`up` runs. Run `up` at the start with start set then, give the reservationId "
                                         "of one you made, or use capacity-block for a future window")]
    return []


def notice_s(cloud: str, market: str) -> int:
    """Seconds before a reservation's end the cloud starts taking its nodes back."""
    return int(cat.load_yaml("reservations.yaml")["markets"].get(market, {}).get("noticeS", 0))


def _length(market: str) -> tuple[timedelta, timedelta]:
    row = cat.load_yaml("reservations.yaml")["markets"][market]
    return timedelta(days=float(row["minDays"])), timedelta(days=float(row["maxDays"]))


def check_market(group: NodeGroup, market: Market, path: str) -> list[Problem]:
    extra = [k for k in ("start", "end", "reservation_id", "reserved_nodes", "overflow")
             if getattr(market, k) is not None]
    if not market.reservation:
        return [Problem(f"{path}.{extra[0].split('_')[0] + ''.join(w.title() for w in extra[0].split('_')[1:])}",
                        f"applies only to a reservation market (capacity-block, capacity-reservation, "
                        f"elasticity-assurance), not {market.type}")] if extra else []
    if group.kind != "vm":
        return [Problem(f"{path}.type", f"{market.type} is built for VM fleets (kind: vm); a kubernetes pool buys "
                                        "spot, on-demand or reserved")]
    if market.start is None or market.end is None:
        return [Problem(path, f"{market.type} needs start and end (ISO 8601 with the offset, e.g. start: "
                              "2026-12-20T08:00:00Z, end: 2026-12-24T08:00:00Z)")]
    out = []
    least, most = _length(market.type)
    if market.end <= market.start:
        out.append(Problem(f"{path}.end", f"{market.end.isoformat()} is not after start {market.start.isoformat()}"))
    elif market.end <= (today := now()):
        out.append(Problem(f"{path}.end", f"{market.end.isoformat()} has passed (now {today.isoformat()}): the "
                                          "reservation is over; give this group a new window or another market"))
    elif not least <= market.end - market.start <= most:
        out.append(Problem(f"{path}.end", f"a {market.type} lasts {least.days} to {most.days} days; this one lasts "
                                          f"{(market.end - market.start).total_seconds() / 86400:g} (infra/data/"
                                          "reservations.yaml)"))
    if not out:
        out += _bought(market, path)
    if market.capacity_block and market.reservation_id is None:
        out.append(Problem(f"{path}.reservationId", "a Capacity Block is bought outside the stack (EC2 "
                                                    "PurchaseCapacityBlock): give its id, e.g. cr-0123456789abcdef0"))
    if market.reserved_nodes is not None and market.reserved_nodes > group.scaling.max:
        out.append(Problem(f"{path}.reservedNodes", f"{market.reserved_nodes} exceeds scaling.max ({group.scaling.max})"))
    elif market.overflow is None and market.reserved_nodes is not None and market.reserved_nodes < group.scaling.max:
        out.append(Problem(f"{path}.reservedNodes", f"{market.reserved_nodes} is under scaling.max "
                                                    f"({group.scaling.max}) with no overflow: the nodes above it would "
                                                    "launch outside the reservation at on-demand; raise reservedNodes "
                                                    "or set overflow: spot"))
    elif market.overflow is not None and market.reserved_of(group.scaling.max) >= group.scaling.max:
        out.append(Problem(f"{path}.overflow", f"nothing overflows: reservedNodes ({market.reserved_of(group.scaling.max)}) "
                                               f"is scaling.max; lower reservedNodes or raise scaling.max"))
    if market.overflow is not None and market.capacity_block:
        out.append(Problem(f"{path}.overflow", "a Capacity Block's launch template buys only from the block: use "
                                               "capacity-reservation for a baseline that bursts to spot"))
    return out


def targeted(spec: StackSpec, group: NodeGroup, market: Market, path: str) -> list[Problem]:
    """A reservation targeted by id (a Capacity Block, a given ODCR) holds one type in one zone: a
    group whose other types or zones it cannot serve would launch them outside it."""
    sites = cat.load_capabilities()["markets"].get(group.cloud, {})
    if market.reservation_id is None or not market.targetable or \
            any(market.type in refused for refused in sites.values()):  # not sold there: the markets check says so
        return []
    if group.instance_type is None or group.fallback_types:
        return [Problem(f"{path}.reservationId", f"{market.reservation_id} holds one instance type: give the group "
                                                 "instanceType (the reservation's) and no fallbackTypes")]
    net = next((n for n in spec.networks if n.name == group.network), None)
    zones = sorted({s.zone for s in net.subnets}) if net is not None else []
    if len(zones) > 1:
        return [Problem(f"{path}.reservationId", f"{market.reservation_id} is in one zone, but network "
                                                 f"{group.network}'s subnets span {', '.join(zones)}: give the group a "
                                                 "network whose subnets are in the reservation's zone only")]
    return []


def check(spec: StackSpec) -> list[Problem]:
    out: list[Problem] = []
    for i, group in enumerate(spec.node_groups):
        out += check_market(group, group.market, f"nodeGroups[{i}].market") or targeted(
            spec, group, group.market, f"nodeGroups[{i}].market")
        for k, cand in enumerate(group.capacity):
            if cand.market is not None:
                out += check_market(group, cand.market, f"nodeGroups[{i}].capacity[{k}].market")
    return out
