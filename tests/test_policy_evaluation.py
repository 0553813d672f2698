"""The offline evaluation (rules.evaluate) finds the GPU capacities once for all its rules
(resources.Evaluation) and reports exactly what each rule reports on a plain list of its own, the
way the policy engine runs it."""

from __future__ import annotations

from typing import Any

import pytest

from infra.plan.__main__ import registered
from infra.plan.engine import unwrap_secrets
from infra.stack import policy_config
from policies.gts_policy import rules, rules_cost
from policies.gts_policy.resources import Evaluation, Res


@pytest.fixture(scope="module")
def prod() -> tuple[list[Res], dict[str, Any]]:
    _, resolved, resources = registered("prod")
    views = [Res(r.type, r.name, unwrap_secrets(r.inputs), bool(r.options.get("protect"))) for r in resources]
    return views, policy_config.for_stack("prod", resolved)


def _as_the_engine(views: list[Res], config: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each enabled rule on a plain list of its own, as the pack's stack policies get one."""
    found = []
    for rule in rules.RULES:
        level, settings = rules.configured(rule, config)
        if level != "disabled":
            found += [(rule.name, name, message) for name, message in rule.run(list(views), settings)]
    return found


def test_the_evaluation_reports_what_each_rule_reports_alone(prod: tuple[list[Res], dict[str, Any]]) -> None:
    views, config = prod
    # Caps low enough that the capacity rules have something to say about prod.
    config = {**config, "stack-cost-cap": {**config.get("stack-cost-cap", {}), "enforcementLevel": "mandatory",
                                           "maxHourlyUsd": 1.0},
              "gpu-max-nodes": {"enforcementLevel": "mandatory", "maxNodesPerGroup": 1}}
    evaluated = [(v["policy"], v["resource"], v["message"].removesuffix(
        " (remediated: the engine applies the fix before the resource is created)")) for v in rules.evaluate(views, config)]
    assert evaluated == _as_the_engine(views, config)
    assert {"stack-cost-cap", "gpu-max-nodes"} <= {p for p, _, _ in evaluated}


def test_the_capacities_are_found_once_per_evaluation(prod: tuple[list[Res], dict[str, Any]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    views, config = prod
    calls = []
    real = rules_cost._find_capacities

    def counted(resources: list[Res]) -> Any:
        calls.append(len(resources))
        return real(resources)

    monkeypatch.setattr(rules_cost, "_find_capacities", counted)
    rules.evaluate(views, config)
    assert calls == [len(views)]
    rules.evaluate(views, config)  # a new evaluation finds them again (nothing kept between runs)
    assert calls == [len(views)] * 2
    # A plain list (the engine's) is not remembered: each rule finds them.
    rules_cost.stack_cost_cap(list(views), {})
    rules_cost.max_nodes(list(views), {"maxNodesPerGroup": 1})
    assert len(calls) == 4


def test_a_rule_cannot_change_what_the_next_one_reads(prod: tuple[list[Res], dict[str, Any]]) -> None:
    views, _ = prod
    shared = Evaluation(views)
    first = rules_cost._capacities(shared)
    first.clear()  # a rule that changed the list it got
    assert rules_cost._capacities(shared)
