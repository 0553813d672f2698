"""The stack program: read the spec once, build one platform component per cloud, export.

`__main__.py` calls `main()`; `make plan` runs the same function in Pulumi's mock engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pulumi

from infra import monitoring
from infra import spec as spec_mod
from infra import validation
from infra.clouds import platform_class
from infra.errors import SpecError

SCALAR_KEYS = ("env",)


def decode(values: Mapping[str, str]) -> dict[str, Any]:
    """Config strings (as the engine hands them to the program) to spec values: structured
    keys are JSON, scalar keys stay strings; unknown keys pass through for the spec to name."""
    raw: dict[str, Any] = {}
    for key, text in values.items():
        if key in SCALAR_KEYS:
            raw[key] = text
            continue
        try:
            raw[key] = json.loads(text)
        except json.JSONDecodeError:
            raw[key] = text  # pydantic then says which type it expected
    return raw


def raw_config(config: pulumi.Config) -> dict[str, Any]:
    """The stack's config values under this project's namespace, objects decoded."""
    return decode({k: v for k in spec_mod.CONFIG_KEYS if (v := config.get(k)) is not None})


def spec_from_values(values: Mapping[str, str], project: str, source: str) -> spec_mod.StackSpec:
    """The spec from a full config map (`<project>:<key>` -> string), as `make plan` reads it."""
    prefix = f"{project}:"
    return validation.parse(decode({k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}), source)


def load_stack_spec(stack: str) -> spec_mod.StackSpec:
    """The spec of `Pulumi.<stack>.yaml`, read as pulumi would (for make userdata / monitoring)."""
    from infra.plan.engine import project_name, read_stack_file, stack_path

    path = stack_path(stack)
    return spec_from_values(read_stack_file(path, project_name()).values, project_name(), path.name)


def read_spec() -> spec_mod.StackSpec:
    """Parse and check the spec; a bad spec stops the program before any resource exists."""
    source = f"Pulumi.{pulumi.get_stack()}.yaml"
    return validation.parse(raw_config(pulumi.Config()), source)


def main() -> None:
    try:
        spec = read_spec()
    except SpecError as exc:
        # RunError is printed by the engine without a Python traceback.
        raise pulumi.RunError(str(exc)) from None
    exports: dict[str, Any] = {}
    for cloud in spec.clouds:
        platform = platform_class(cloud)(f"{spec.env}-{cloud}", spec)
        exports[cloud] = platform.exports
    for name, values in exports.items():
        pulumi.export(name, values)
    # For the team's Prometheus and Grafana, as `make monitoring` writes them:
    # `pulumi stack output alertRules > rules.yml`, `pulumi stack output grafanaDashboard > dashboard.json`.
    pulumi.export("alertRules", monitoring.render(spec))
    pulumi.export("grafanaDashboard", monitoring.render_dashboard(spec))
