"""Where a rule is written is where it is registered: `@stack_rule(...)` or `@resource_rule(...)`
on its check records it under its module, in the order the module defines them. rules.py lists
the rule modules in the pack's order (cost, security, capacity) and joins their rules as RULES,
whatever order they were imported in; the pack's entry (policies/__main__.py), the offline
evaluation (rules.evaluate) and the policy config (infra/stack/policy_config.py) read RULES, and
tests/test_pack_registry.py holds it to the table in docs/policies.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

from .resources import Res

ResourceCheck = Callable[[Res, Mapping[str, Any]], list[str]]
StackCheck = Callable[[list[Res], Mapping[str, Any]], list[tuple[str, str]]]
Remediation = Callable[[Res], dict[str, Any] | None]
Schema = dict[str, dict[str, Any]]
LEVELS = ("mandatory", "advisory", "remediate", "disabled")


@dataclass(frozen=True)
class Violation:
    policy: str
    resource: str
    message: str


@dataclass(frozen=True)
class Rule:
    """A stack rule (`check` over every resource: cost, spot share, cross-resource settings) or a
    resource rule (`per_resource` over one resource, served to the engine as a resource
    validation policy that runs before that resource is created, with `remediate` where the fix
    is safe and unambiguous)."""

    name: str
    description: str
    enforcement: str  # mandatory | advisory | remediate | disabled (default; per-env files override)
    check: StackCheck | None = None
    schema: Schema = field(default_factory=dict)
    per_resource: ResourceCheck | None = None
    remediate: Remediation | None = None

    def run(self, resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
        if self.per_resource is not None:
            return [(r.name, m) for r in resources for m in self.per_resource(r, cfg)]
        assert self.check is not None
        return self.check(resources, cfg)


_BY_MODULE: dict[str, list[Rule]] = {}  # module name -> its rules, as written


def registered(module: ModuleType) -> list[Rule]:
    """The rules a module registered, in the order it defines them."""
    return list(_BY_MODULE.get(module.__name__, []))


def modules() -> set[str]:
    """The modules that registered rules (imported so far)."""
    return set(_BY_MODULE)


def _register(module: str, rule: Rule) -> None:
    assert rule.enforcement in LEVELS, f"{rule.name}: enforcement {rule.enforcement!r} is not one of {LEVELS}"
    assert all(r.name != rule.name for rs in _BY_MODULE.values() for r in rs), \
        f"policy rule {rule.name!r} is registered twice"
    _BY_MODULE.setdefault(module, []).append(rule)


S = TypeVar("S", bound=StackCheck)
R = TypeVar("R", bound=ResourceCheck)


def stack_rule(name: str, description: str, enforcement: str, schema: Schema | None = None) -> Callable[[S], S]:
    """Register the decorated check over all of the stack's resources as the rule `name`."""
    def register(check: S) -> S:
        _register(check.__module__, Rule(name, description, enforcement, check, dict(schema or {})))
        return check
    return register


def resource_rule(name: str, description: str, enforcement: str, schema: Schema | None = None,
                  remediate: Remediation | None = None) -> Callable[[R], R]:
    """Register the decorated check of one resource as the rule `name` (with its remediation)."""
    def register(check: R) -> R:
        _register(check.__module__, Rule(name, description, enforcement, schema=dict(schema or {}),
                                         per_resource=check, remediate=remediate))
        return check
    return register
