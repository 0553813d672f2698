"""The shared mocks harness: run the stack program on a stack file (or a variant of one) in
Pulumi's mock engine and capture every registered resource (type, name, URN, parent, inputs)."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from infra.model.spec import StackSpec
from infra.plan.engine import Registered, run_program
from infra.plan.invokes import COMPUTED, INVOKES
from infra.stack.stackfile import decode, project_name, read_stack_file

ROOT = Path(__file__).resolve().parents[1]

PROJECT = "gpu-training-stack"


def stack_values(stack: str) -> dict[str, Any]:
    """The `config:` mapping of a shipped stack file, as YAML data (deep copy, safe to edit)."""
    data = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())
    return copy.deepcopy(data["config"])


def key(name: str) -> str:
    return f"{PROJECT}:{name}"


def write_stack(tmp: Path, name: str, config: dict[str, Any]) -> Path:
    path = tmp / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump({"config": config}, sort_keys=False))
    return path


def run_stack(stack: str = "dev", edit: Callable[[dict[str, Any]], None] | None = None,
              tmp: Path | None = None) -> list[Registered]:
    """Run __main__.py under mocks on a shipped stack, optionally edited first."""
    if edit is None:
        config = read_stack_file(ROOT / f"Pulumi.{stack}.yaml", project_name())
    else:
        assert tmp is not None, "an edited stack needs a tmp dir"
        values = stack_values(stack)
        edit(values)
        config = read_stack_file(write_stack(tmp, stack, values), project_name())
    return run_program(config, INVOKES, COMPUTED)


@functools.cache
def shipped(stack: str) -> tuple[Registered, ...]:
    """A shipped stack's registrations, run once per test session and shared by every test file."""
    return tuple(run_stack(stack))


# What a checkout of the project holds that the stack program reads: the program, the stack
# files' project, its packages, the node bootstrap and the trainer (bundled onto nodes).
PROGRAM_FOLDERS = ("infra", "policies", "cloudinit", "training")


def project_copy(tmp: Path) -> Path:
    """A copy of the project without its stack files (folders linked), to run commands in."""
    proj = tmp / "proj"
    proj.mkdir()
    for name in ("Pulumi.yaml", "__main__.py", "teams.yaml"):
        (proj / name).write_text((ROOT / name).read_text())
    for folder in PROGRAM_FOLDERS:
        (proj / folder).symlink_to(ROOT / folder)
    return proj


def by_type(resources: list[Registered], type_token: str) -> list[Registered]:
    return [r for r in resources if r.type == type_token]


def spec_raw(config: dict[str, Any]) -> dict[str, Any]:
    """Config values as the program decodes them: project keys only, through the CLI's JSON
    encoding and the program's own decoding."""
    prefix = PROJECT + ":"
    return decode({k[len(prefix):]: v if isinstance(v, str) else json.dumps(v)
                   for k, v in config.items() if k.startswith(prefix)})


def policy_hits(resources: Iterable[Registered], rule: str, settings: dict[str, Any] | None = None) -> list[str]:
    """Resources the policy pack's own rule reports on these registrations (the rule enabled as
    mandatory with `settings`): tests check the project's rule, never a copy of it."""
    from policies.gts_policy.resources import Res
    from policies.gts_policy.rules import evaluate

    views = [Res(r.type, r.name, r.inputs, bool(r.options.get("protect"))) for r in resources]
    config = {rule: {"enforcementLevel": "mandatory", **(settings or {})}}
    return sorted(v["resource"] for v in evaluate(views, config) if v["policy"] == rule)


def parse_spec(raw: dict[str, Any], source: str = "stack config") -> StackSpec:
    """validation.parse as the program's edge calls it: the team registry a queued stack names
    (kubernetes.queues) read from this checkout and handed in."""
    from infra.checks.validation import parse
    from infra.stack.stackfile import teams_reader

    return parse(raw, source, teams_reader(ROOT))
