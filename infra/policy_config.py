"""The policy pack's config for one stack: the environment's file (policies/<stack or env>.json)
plus the values that must agree with the stack — the CNY rate the stack prices with, its
budget, its thresholds and its planned monthly cost — so that `make plan` and a real
`pulumi preview --policy-pack policies --policy-pack-config <this file>` give the same verdicts.

    make policy-config STACK=prod        # writes out/policy-config-prod.json
"""

from __future__ import annotations

import json
from typing import Any

from infra.cost import stack_cost
from infra.groups import Stack
from infra.stackfile import project_root
from policies.gts_policy.rules import RULES


def base_config(stack_name: str, env: str) -> dict[str, Any]:
    folder = project_root() / "policies"
    path = next((p for p in (folder / f"{stack_name}.json", folder / f"{env}.json") if p.exists()), None)
    return json.loads(path.read_text(encoding="utf-8")) if path else {}


def for_stack(stack_name: str, stack: Stack) -> dict[str, Any]:
    spec = stack.spec
    planned = stack_cost(stack)["monthly_usd"]
    derived = {"cnyPerUsd": spec.pricing.cny_per_usd, "budgetMonthlyUsd": spec.budget.monthly_limit_usd,
               "thresholdsPercent": list(spec.budget.thresholds_percent), "plannedMonthlyUsd": planned}
    out: dict[str, Any] = dict(base_config(stack_name, spec.env))
    for rule in RULES:
        wanted = {k: v for k, v in derived.items() if k in rule.schema}
        if not wanted:
            continue
        entry = out.get(rule.name, {})
        settings = dict(entry) if isinstance(entry, dict) else {"enforcementLevel": entry}
        out[rule.name] = {**settings, **wanted}
    return out
