"""The rules: cost, spot, hardware, security and tagging. Each is a function over all of the
stack's resources (a cloud-neutral `Res` view) and its config, returning violations that name
the resource, the rule and the fix. Specs and prices come from the stack's own GPU catalog.

The checks live by topic (rules_cost.py: cost, spot and hardware; rules_security.py: security,
protection and tags; rules_capacity.py: capacity candidates), each registered where it is
written (`@stack_rule` / `@resource_rule`, registry.py); RULES joins them in the pack's order
(RULE_MODULES), and this module evaluates them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import rules_capacity, rules_cost, rules_security
from . import registry
from .registry import Rule, Violation
from .resources import Evaluation, Res

__all__ = ["Violation", "Rule", "RULES", "RULE_MODULES", "configured", "evaluate", "OFFLINE_ADVISORY"]

# The modules whose rules the pack serves, in its order; within one, a rule's place is where it is written.
RULE_MODULES = (rules_cost, rules_security, rules_capacity)
RULES: list[Rule] = [rule for module in RULE_MODULES for rule in registry.registered(module)]
assert registry.modules() <= {m.__name__ for m in RULE_MODULES}, "a module registers rules the pack does not serve"


def configured(rule: Rule, config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(enforcement level, settings) of a rule in a policy-pack config file's content:
    {rule: "mandatory" | "advisory" | "remediate" | "disabled" | {"enforcementLevel": ..., <settings>}}."""
    entry = config.get(rule.name, {})
    settings = dict(entry) if isinstance(entry, Mapping) else {"enforcementLevel": entry}
    level = str(settings.pop("enforcementLevel", rule.enforcement))
    return level, settings


def evaluate(resources: list[Res], config: Mapping[str, Any]) -> list[dict[str, str]]:
    """Run every enabled rule, as the engine would with this config (the work several rules
    derive from all the resources alike done once: resources.Evaluation)."""
    resources = Evaluation(resources)
    found = []
    for rule in RULES:
        level, settings = configured(rule, config)
        if level == "disabled":
            continue
        if level == "remediate" and rule.remediate is None:
            level = "mandatory"  # as the engine treats a policy without a remediation
        for resource, message in rule.run(resources, settings):
            if level == "remediate":
                message += " (remediated: the engine applies the fix before the resource is created)"
            found.append({"policy": rule.name, "enforcement": level, "resource": resource, "message": message})
    return found


# Rules whose offline verdict is advisory whatever the pack config says: the offline plan of a
# shipped example stack must plan, while a real preview with the pack refuses it.
OFFLINE_ADVISORY = ("kubernetes-api-sources-routable",)
