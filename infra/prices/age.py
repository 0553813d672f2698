"""How old the prices a stack is planned with are: every figure rests on infra/data/prices.csv,
and a price list moves. The age is a policy verdict (the pack's prices-fresh rule: advisory by
default, older than 90 days unless the pack config says otherwise), shown with the age and the
refresh command, `make prices`; the calendar alone never stops a plan, a preview or an up."""

from __future__ import annotations

import datetime
from typing import Any

from infra.core.clock import judged_on
from infra.resolve.groups import Stack

ADVISORY_DAYS = 90  # the pack's default maxAgeDays (policies/gts_policy/rules_cost.py prices_fresh)


OVERRIDE = "stack override"  # pricing.overrides: the stack's own figure, dated by nobody but the stack


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


def verdict_config(stack: Stack, today: datetime.date | None = None) -> dict[str, Any]:
    """What the pack's prices-fresh rule judges (infra/stack/policy_config.py): the oldest price's date,
    where it is used and the date it is judged at. Nothing when every price is the stack's own
    override or the stack sets pricing.allowStalePrices."""
    if stack.spec.pricing.allow_stale_prices:
        return {}
    found = summary(stack, today)
    if found["oldest"] is None:
        return {}
    return {"pricesDated": parse(str(found["oldest"]["date"])).isoformat(), "pricesOldest": _where(found["oldest"]),
            "pricesJudgedOn": (today or judged_on()).isoformat()}
