"""The stack program: read the spec once, build one platform component per cloud, export.

`__main__.py` calls `main()`; `make plan` runs the same function in Pulumi's mock engine.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import monitoring, protection, userdata
from infra import spec as spec_mod
from infra import validation
from infra.clouds import platform_class
from infra.errors import SpecError
from infra.groups import Stack, resolve
from infra.stackfile import decode

def raw_config(config: pulumi.Config) -> dict[str, Any]:
    """The stack's config values under this project's namespace, objects decoded."""
    return decode({k: v for k in spec_mod.CONFIG_KEYS if (v := config.get(k)) is not None})


def read_spec() -> spec_mod.StackSpec:
    """Parse and check the spec; a bad spec stops the program before any resource exists."""
    source = f"Pulumi.{pulumi.get_stack()}.yaml"
    return validation.parse(raw_config(pulumi.Config()), source)


def load() -> Stack:
    """The stack's spec, checked and resolved, and its nodes' user data sized: every user error
    surfaces here, before any resource is registered."""
    spec = read_spec()
    stack = resolve(spec)
    problems = userdata.check_sizes(stack)
    if problems:
        raise SpecError(problems, f"Pulumi.{pulumi.get_stack()}.yaml")
    return stack


def main() -> None:
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
    pulumi.export("alertRules", monitoring.render(spec))
    pulumi.export("grafanaDashboard", monitoring.render_dashboard(spec))
