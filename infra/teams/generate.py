"""An isolated team's stack file, generated from the org's base stack and the team's entry in
the registry: never edited by hand, the same bytes for the same inputs (a test compares the
committed files with a fresh generation).

From the base stack (Pulumi.<org.baseStack>.yaml): the non-project keys (providers), clouds (only
the team's, without the account-wide settings the base stack owns; the team's first region),
Kubernetes access, storage (the team's bucket prefix), training, pricing and protectStateful.
From the team: env and stack team-<name>, tags (owner, cost-center, env, team), its limits
(`team:` — regions, GPU quota, markets, the policy settings to start from), networks, peerings,
node groups, and its budget with its owners as the alert list.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from infra.checks import validation
from infra.core.errors import Problem, SpecError
from infra.model.stacktext import (GENERATED, StackFileError, is_generated, load_yaml, project_name, read_stack_text,
                             read_text)
from infra.teams.registry import REGISTRY, STACK_PREFIX, Registry, RegistryError, Team, bucket_prefix, load

HEADER = GENERATED + " from {registry} (team {team}) and Pulumi.{base}.yaml. Do not edit:\n" \
         "# change {registry} and run `make teams`; a test fails when this file and the registry differ.\n"
FROM_BASE = ("protectStateful", "kubernetes", "storage", "training", "pricing")


def _dump(model: Any) -> Any:
    """A spec model as the stack file spells it (camelCase, unset defaults left out)."""
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True)


def stack_config(team: Team, registry: Registry, root: Path) -> dict[str, Any]:
    """The team stack's `config:` mapping, in the documented key order."""
    project = project_name(root)
    base_path = root / f"Pulumi.{registry.org.base_stack}.yaml"  # read as strictly as any stack file
    base = (load_yaml(read_text(base_path), base_path.name) or {}).get("config") or {}
    own = {k.split(":", 1)[1]: v for k, v in base.items() if k.startswith(f"{project}:")}
    assert team.stack is not None  # an isolated team (the registry checks)
    env = f"{STACK_PREFIX}{team.name}"
    config: dict[str, Any] = {k: v for k, v in base.items() if not k.startswith(f"{project}:")}
    values: dict[str, Any] = {
        "env": env,
        "team": {"name": team.name, "policies": registry.org.base_stack,
                 "regions": {c: list(r) for c, r in team.regions.items()},
                 "gpus": {c: dict(q) for c, q in team.gpus.items()},
                 "spotOnly": team.markets.spot_only, "onDemandBaseMax": team.markets.on_demand_base_max},
        "tags": {"owner": team.name, "cost-center": team.cost_center, "env": env, "team": team.name},
        "clouds": {c: {**{k: v for k, v in own["clouds"][c].items() if k != "accountSettings"},
                       "region": team.regions[c][0]} for c in team.regions if c in own.get("clouds", {})},
        "networks": [_dump(n) for n in team.stack.networks],
        "peerings": [_dump(p) for p in team.stack.peerings],
        "nodeGroups": [_dump(g) for g in team.stack.node_groups],
        "budget": {"monthlyLimitUsd": team.monthly_budget_usd, "alertEmails": list(team.owners)},
    }
    for key in FROM_BASE:
        if key in own:
            values[key] = own[key]
    values.setdefault("protectStateful", True)  # a team's buckets and clusters are production data
    if "storage" in values:
        values["storage"] = {**values["storage"], "bucketPrefix": bucket_prefix(registry, team)}
    if isinstance(values.get("kubernetes"), dict):  # the base's shared queues are not the team's
        values["kubernetes"] = {k: v for k, v in values["kubernetes"].items() if k != "queues"}
    if not values["peerings"]:
        del values["peerings"]
    order = ("env", "protectStateful", "team", "tags", "clouds", "networks", "peerings", "nodeGroups", "kubernetes",
             "storage", "training", "budget", "pricing")
    config |= {f"{project}:{k}": values[k] for k in order if k in values}
    return config


def render(team: Team, registry: Registry, root: Path) -> str:
    header = HEADER.format(registry=REGISTRY, team=team.name, base=registry.org.base_stack)
    body = yaml.safe_dump({"config": stack_config(team, registry, root)}, sort_keys=False, width=120,
                          allow_unicode=True)
    return header + body


def stack_files(registry: Registry, root: Path) -> dict[Path, str]:
    """Every isolated team's generated stack file and its content."""
    return {root / f"Pulumi.{t.stack_name}.yaml": render(t, registry, root)
            for t in registry.teams if t.placement == "isolated"}


def validate(registry: Registry, root: Path, files: dict[Path, str]) -> None:
    """Every generated stack is a valid stack spec before any is written: its problems are
    reported against the team's entry in teams.yaml (its stack.networks / nodeGroups), and a
    hand-written file of that name is never replaced."""
    problems: list[Problem] = []
    for team in registry.teams:
        path = root / f"Pulumi.{team.stack_name}.yaml"
        if path not in files:
            continue
        i = registry.index(team.name)
        if path.exists() and not is_generated(path):
            problems.append(Problem(f"teams[{i}].name", f"{path.name} exists and is hand-written (no GENERATED "
                                                        "header): rename the team or move that file"))
            continue
        project = project_name(root)
        try:  # read as the Pulumi CLI will read the file
            validation.parse_values(read_stack_text(files[path], path.name, project).values, project, path.name,
                                    functools.partial(load, root))
        except SpecError as exc:
            problems += [Problem(_team_path(i, p.path), p.message) for p in exc.problems]
    if problems:
        raise RegistryError(problems, REGISTRY)


def _team_path(i: int, path: str) -> str:
    """A generated stack's key path as the team's entry in teams.yaml spells it."""
    head = path.split(".", 1)[0].split("[", 1)[0]
    if head in ("networks", "peerings", "nodeGroups"):
        return f"teams[{i}].stack.{path}"
    return f"teams[{i}] (generated {path}, from the base stack)"


def write(registry: Registry, root: Path) -> tuple[list[Path], list[Path]]:
    """Write the team stacks that changed and remove generated ones whose team left the registry:
    (written, removed). Nothing is written unless every team stack is valid; hand-written stack
    files are never touched."""
    files = stack_files(registry, root)
    validate(registry, root, files)
    written = [p for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    stale = [p for p in sorted(root.glob(f"Pulumi.{STACK_PREFIX}*.yaml")) if p not in files and is_generated(p)]
    for path in [*written, *stale]:
        try:
            path.write_text(files[path], encoding="utf-8") if path in files else path.unlink()
        except OSError as exc:
            raise StackFileError(f"{path.name}: cannot be {'written' if path in files else 'removed'} "
                                 f"({exc.strerror}); make teams keeps the team stacks in the checkout: run it where "
                                 "you can write (CI: `python -m infra.teams.report --check` compares only)") from None
    return written, stale


def drift(registry: Registry, root: Path) -> list[str]:
    """What differs between the committed team stacks and a fresh generation (empty: none)."""
    files = stack_files(registry, root)
    out = [f"{p.name} is missing" for p in files if not p.exists()]
    out += [f"{p.name} differs from the registry" for p, text in files.items()
            if p.exists() and p.read_text(encoding="utf-8") != text]
    out += [f"{p.name} belongs to no team in the registry" for p in sorted(root.glob(f"Pulumi.{STACK_PREFIX}*.yaml"))
            if p not in files and is_generated(p)]
    return out


def _differences(have: Any, want: Any, path: str) -> list[str]:
    """Key paths where `have` (the file) differs from `want` (a fresh generation)."""
    if isinstance(have, dict) and isinstance(want, dict):
        out = []
        for k in [*want, *(k for k in have if k not in want)]:
            out += _differences(have.get(k), want.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
        return [d for i, (h, w) in enumerate(zip(have, want)) for d in _differences(h, w, f"{path}[{i}]")]
    return [] if have == want else [path]


def stack_drift(path: Path, root: Path) -> list[str]:
    """For a generated team stack (GENERATED header): the keys where it differs from what the
    registry and the base stack generate now, each with the file's value and the registry's
    (empty: none, or not a generated stack). A hand edit of a generated stack — more GPUs in
    `team.gpus`, another region — is refused by `make plan` and `make policy-config`, not
    honoured: the registry, reviewed, is the only source."""
    if not is_generated(path):
        return []
    registry = load(root)
    team = next((t for t in registry.teams if t.placement == "isolated" and t.stack_name == path.name[7:-5]), None)
    if team is None:
        return [f"{path.name} is generated, but no isolated team in {REGISTRY} generates it: remove it, or add the "
                f"team to {REGISTRY} and run `make teams`"]
    want = yaml.safe_load(render(team, registry, root))["config"]
    have = (load_yaml(read_text(path), path.name) or {}).get("config") or {}
    out = []
    for key in _differences(have, want, ""):
        out.append(f"{key} differs from {REGISTRY} (team {team.name}) and Pulumi.{registry.org.base_stack}.yaml; "
                   f"a generated stack is never edited: change {REGISTRY} and run `make teams`")
    return out
