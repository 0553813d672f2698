"""The stack program: read the spec once, build one platform component per cloud, export.

`__main__.py` calls `main()`, which reads the stack from Pulumi's config (the edge of `pulumi up`);
`make plan` reads the stack file at its own edge and runs `main(stack)` in Pulumi's mock engine.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import monitoring, userdata
from infra.checks import validation
from infra.clouds import platform_class
from infra.core.errors import SpecError
from infra.model import spec as spec_mod
from infra.render import protection
from infra.resolve.groups import Stack
from infra.stack.stackfile import decode, teams_reader

def raw_config(config: pulumi.Config) -> dict[str, Any]:
    """The stack's config values under this project's namespace, objects decoded."""
    return decode({k: v for k in spec_mod.CONFIG_KEYS if (v := config.get(k)) is not None})


def read_stack() -> Stack:
    """Parse and check the spec, its groups resolved once; a bad spec stops the program before any
    resource exists. The team registry a queued stack names is read here, once."""
    source = f"Pulumi.{pulumi.get_stack()}.yaml"
    return validation.parse_stack(raw_config(pulumi.Config()), source, teams_reader())


def read_spec() -> spec_mod.StackSpec:
    return read_stack().spec


def sized(stack: Stack, source: str) -> Stack:
    """The stack once its nodes' user data fits every cloud's limit (SpecError otherwise)."""
    problems = userdata.check_sizes(stack)
    if problems:
        raise SpecError(problems, source)
    return stack


def load() -> Stack:
    """The stack's spec, checked and resolved, and its nodes' user data sized: every user error
    surfaces here, before any resource is registered."""
    return sized(read_stack(), f"Pulumi.{pulumi.get_stack()}.yaml")


def main(stack: Stack | None = None) -> None:
    """Build the stack: the one handed in (read and sized at the caller's edge: the offline
    plan), else the one Pulumi's config holds."""
    if stack is None:
        try:
            stack = load()
        except SpecError as exc:
            # RunError is printed by the engine without a Python traceback.
            raise pulumi.RunError(str(exc)) from None
    spec = stack.spec
    protection.register(spec)  # before any resource: the stateful ones are protected (prod)
    exports: dict[str, Any] = {}
    for cloud in spec.clouds:
        platform = platform_class(cloud)(f"{spec.env}-{cloud}", stack)
        exports[cloud] = platform.exports
    for name, values in exports.items():
        pulumi.export(name, values)
    # For the team's Prometheus and Grafana, as `make monitoring` writes them:
    # `pulumi stack output alertRules > rules.yml`, `pulumi stack output grafanaDashboard > dashboard.json`.
    pulumi.export("alertRules", monitoring.render(spec, stack))
    pulumi.export("grafanaDashboard", monitoring.render_dashboard(spec))
