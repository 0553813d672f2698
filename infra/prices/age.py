"""How old the prices a stack is planned with are: every figure rests on infra/data/prices.csv,
and a price list moves. Older than 90 days is an advisory in the plan; older than a year an
error (exit 2) unless `pricing.allowStalePrices: true` — refresh them with `make prices`."""

from __future__ import annotations

import datetime
import os
from typing import Any

from infra.errors import Problem
from infra.groups import Stack, resolve
from infra.spec import StackSpec

ADVISORY_DAYS = 90
ERROR_DAYS = 365


OVERRIDE = "stack override"  # pricing.overrides: the stack's own figure, dated by nobody but the stack


def judged_on() -> datetime.date:
    """The date prices are judged at: GTS_TODAY (YYYY-MM-DD, for a reproducible plan of an old
    change, and the tests) or today."""
    pinned = os.environ.get("GTS_TODAY")
    return datetime.date.fromisoformat(pinned) if pinned else datetime.date.today()


def parse(text: str) -> datetime.date:
    """A price's date: YYYY-MM-DD, or YYYY-MM read as the month's first day (the older end)."""
    parts = [int(p) for p in text.split("-")]
    return datetime.date(parts[0], parts[1], parts[2] if len(parts) > 2 else 1)


def used(stack: Stack) -> list[dict[str, Any]]:
    """The price rows the stack's groups are planned with: each type of each group, in its region."""
    catalog = stack.spec.catalog()
    rows = []
    for rg in stack.groups:
        for itype in rg.types:
            item = catalog.priced(rg.cloud, itype, rg.region)
            if item is not None and item.price_source != OVERRIDE:
                rows.append({"group": rg.name, "type": itype, "region": rg.region, "date": item.price_date,
                             "source": item.price_source, "estimate": item.price_estimate})
    return rows


def summary(stack: Stack, today: datetime.date | None = None) -> dict[str, Any]:
    """The oldest price used, its age in days, and every row used (for the plan's cost)."""
    rows = used(stack)
    when = today or judged_on()
    if not rows:  # every price is the stack's own override
        return {"oldest": None, "age_days": 0, "used": []}
    oldest = min(rows, key=lambda r: parse(str(r["date"])))
    return {"oldest": oldest, "age_days": (when - parse(str(oldest["date"]))).days, "used": rows}


def _where(row: dict[str, Any]) -> str:
    return f"{row['type']} in {row['region']} for node group {row['group']}, dated {row['date']} ({row['source']})"


def check_stale(spec: StackSpec, today: datetime.date | None = None) -> list[Problem]:
    if spec.pricing.allow_stale_prices:
        return []
    found = summary(resolve(spec), today)
    if found["oldest"] is None or found["age_days"] <= ERROR_DAYS:
        return []
    return [Problem("pricing", f"the prices this stack is planned with are {found['age_days']} days old (oldest: "
                               f"{_where(found['oldest'])}), over a year: refresh them with `make prices`, or set "
                               "pricing.allowStalePrices: true to plan with them anyway")]


def advisory(stack: Stack, today: datetime.date | None = None) -> dict[str, str] | None:
    """The plan's advisory when the prices are older than 90 days (a violation entry)."""
    found = summary(stack, today)
    if found["oldest"] is None or found["age_days"] <= ADVISORY_DAYS:
        return None
    return {"policy": "prices-fresh", "enforcement": "advisory", "resource": "stack",
            "message": f"prices are {found['age_days']} days old (oldest: {_where(found['oldest'])}); refresh them "
                       f"with `make prices` (over {ADVISORY_DAYS} days: this advisory; over {ERROR_DAYS}: an error)"}
