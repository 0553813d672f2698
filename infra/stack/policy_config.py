"""The policy pack's config for one stack: the environment's file (policies/<stack or env>.json)
plus the values that must agree with the stack — the CNY rate the stack prices with, its
budget, its thresholds and its planned monthly cost — so that `make plan` and a real
`pulumi preview --policy-pack policies --policy-pack-config <this file>` give the same verdicts.

    make policy-config STACK=prod        # writes out/policy-config-prod.json
"""

from __future__ import annotations

import json
from typing import Any

from infra.capacity import pricing
from infra.core.catalog import to_usd
from infra.prices import age
from infra.resolve import spares
from infra.resolve.cost import stack_cost
from infra.resolve.groups import Stack
from infra.stack.stackfile import project_root
from policies.gts_policy.rules import RULES


def base_config(stack_name: str, env: str, fallback: str | None = None) -> dict[str, Any]:
    """policies/<stack>.json, else <env>.json, else (a team stack) the file its registry names."""
    folder = project_root() / "policies"
    names = (stack_name, env, *((fallback,) if fallback else ()))
    path = next((p for p in (folder / f"{n}.json" for n in names) if p.exists()), None)
    return json.loads(path.read_text(encoding="utf-8")) if path else {}


def group_prices(stack: Stack) -> dict[str, dict[str, float]]:
    catalog, rate = stack.spec.catalog(), stack.spec.pricing.cny_per_usd
    out: dict[str, dict[str, float]] = {}
    for g in stack.groups:
        priced = {t: catalog.priced(g.cloud, t, g.region) for t in g.types}
        out[g.name] = {t: round(to_usd(i.price_ondemand, i.currency, rate), 6) for t, i in priced.items() if i}
    return out


def group_spares(stack: Stack) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for g in stack.groups:
        if g.group.scaling.spares:
            f = spares.figures(g)
            out[g.name] = {"spares": f.spares, "world": f.world, "monthlyUsd": f.monthly_usd,
                           "lossesPerMonth": f.losses_per_month}
    return out


def for_stack(stack_name: str, stack: Stack, planned: float | None = None) -> dict[str, Any]:
    """The pack's config for the stack; `planned`: its monthly cost where the caller has it
    (infra/resolve/cost.py stack_cost's monthly_usd), else computed here."""
    spec = stack.spec
    planned = stack_cost(stack)["monthly_usd"] if planned is None else planned
    derived: dict[str, Any] = {
        "cnyPerUsd": spec.pricing.cny_per_usd, "budgetMonthlyUsd": spec.budget.monthly_limit_usd,
        "thresholdsPercent": list(spec.budget.thresholds_percent), "plannedMonthlyUsd": planned,
        # each node group's types at their price in its region, overrides included (USD per node-hour):
        # the pack prices capacity where it runs, as the plan does
        "groupPrices": group_prices(stack),
        # each group's warm spares, their cost and the run's expected member losses (the spares-share rule)
        **({"groupSpares": spared} if (spared := group_spares(stack)) else {}),
        # the date of the oldest price the stack is planned with (the prices-fresh rule)
        **age.verdict_config(stack),
        # each group's places (as declared, then its capacity candidates) priced at the maximum size
        "capacityPlaces": pricing.pack_config(stack)}
    team = spec.team
    if team is not None:  # the registry's quota and markets (teams.yaml, through `make teams`)
        derived |= {"team": team.name, "gpuQuota": {c: dict(q) for c, q in team.gpus.items()},
                    "spotOnly": team.spot_only, "onDemandBaseMax": team.on_demand_base_max}
    out: dict[str, Any] = dict(base_config(stack_name, spec.env, team.policies if team else None))
    for rule in RULES:
        wanted = {k: v for k, v in derived.items() if k in rule.schema}
        if not wanted:
            continue
        entry = out.get(rule.name, {})
        settings = dict(entry) if isinstance(entry, dict) else {"enforcementLevel": entry}
        out[rule.name] = {**settings, **wanted}
    return out
