"""The team registry (`teams.yaml`): which teams exist, what each may use, and the org's limits.

Typed and validated like a stack spec: every problem is reported at once as a key path in the
file's own spelling (`teams[2].gpus.aws.H100`). A registry whose teams ask for more GPUs or
budget than the org has, or that names a cloud the org does not use, is refused.

    version: 1
    org: {name, baseStack, sharedStack, monthlyBudgetUsd, gpus: {<cloud>: {<GPU model>: GPUs}}}
    teams:
      - {name, owners, costCenter, placement: isolated | shared, regions, gpus, markets,
         monthlyBudgetUsd, borrowing, stack: {networks, peerings, nodeGroups}}
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from infra.core import catalog as cat, yamlread
from infra.core.errors import Problem, SpecError
from infra.model.spec import Cloud, Name, NodeGroup, Network, Peering, SpecModel, quota_of
from infra.model.spec_patterns import EMAIL
from infra.model.spec_problems import check_region, problems_of
from infra.model.stacktext import StackFileError, decode, is_generated, project_name, read_stack_file, read_text

REGISTRY = "teams.yaml"
STACK_PREFIX = "team-"  # a team's generated stack (and env) is team-<name>
TeamName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,25}[a-z0-9]$")]  # team-<name> is a Name
Email = Annotated[str, Field(pattern=EMAIL)]  # the owners become the team stack's budget alert addresses
GpuModel = Annotated[str, Field(pattern=r"^[A-Za-z0-9]+$")]
# GPUs per cloud and model: whole numbers above 0 (YAML's true or "16" are refused, not read as 1 or 16)
Quota = dict[Cloud, dict[GpuModel, Annotated[int, Field(gt=0, strict=True)]]]
Usd = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Regions = Annotated[list[str], Field(min_length=1)]


class RegistryError(SpecError):
    """The registry is invalid: exit 2, every problem named."""


class Org(SpecModel):
    name: Name = Field(description="The organisation; prefix of the team stacks' buckets.")
    base_stack: Name = Field(description="The stack every isolated team's stack starts from: its clouds, mirrors, "
                                         "Kubernetes access, storage, training and pricing (Pulumi.<this>.yaml).")
    shared_stack: Name | None = Field(None, description="The stack whose clusters shared teams queue on; it sets "
                                                        "kubernetes.queues: teams.yaml.")
    monthly_budget_usd: Usd = Field(description="The org's monthly budget; the teams' budgets fit in it.")
    gpus: Quota = Field(min_length=1, description="GPUs the org may use per cloud and GPU model.")


class Markets(SpecModel):
    spot_only: bool = Field(True, description="All GPU capacity spot, beyond onDemandBaseMax on-demand nodes.")
    on_demand_base_max: int = Field(0, ge=0, strict=True, description="On-demand nodes kept, all groups together (on a shared "
                                                         "cluster: the share of the quota on on-demand nodes).")


class TeamStack(SpecModel):
    """An isolated team's own networks and node groups; the rest comes from the org's base stack."""

    networks: list[Network] = Field(min_length=1, description="The team's VPCs.")
    peerings: list[Peering] = Field(default_factory=list, description="Links between them.")
    node_groups: list[NodeGroup] = Field(min_length=1, description="The team's GPU node groups.")


class Team(SpecModel):
    name: TeamName = Field(description="2-27 lowercase letters, digits and hyphens; its stack is team-<name>.")
    owners: list[Email] = Field(min_length=1, description="Who owns it; they get its budget alerts.")
    cost_center: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Cost center, tagged on everything.")
    placement: Literal["isolated", "shared"] = Field(description="isolated: a stack of its own; shared: queues on "
                                                                 "the org's shared clusters.")
    regions: dict[Cloud, Regions] = Field(min_length=1, description="Regions it may use, per cloud (the first: "
                                                                   "its stack's default).")
    gpus: Quota = Field(min_length=1, description="Its GPU quota per cloud and GPU model (GPUs, not nodes).")
    markets: Markets = Field(default_factory=Markets, description="How it may buy capacity.")
    monthly_budget_usd: Usd = Field(description="Its monthly budget.")
    borrowing: bool = Field(False, description="Shared: may borrow unused quota of the other teams in the cohort.")
    stack: TeamStack | None = Field(None, description="Isolated: its networks and node groups.")

    @property
    def stack_name(self) -> str:
        return f"{STACK_PREFIX}{self.name}"

    @model_validator(mode="after")
    def _placement(self) -> Team:
        if self.placement == "isolated" and self.stack is None:
            raise ValueError("an isolated team needs stack: {networks, nodeGroups} (or placement: shared)")
        if self.placement == "shared" and self.stack is not None:
            raise ValueError("a shared team queues on the shared clusters: remove stack (or placement: isolated)")
        if self.placement == "isolated" and self.borrowing:
            raise ValueError("borrowing is for shared teams (quota in a cohort); remove it")
        return self


class Registry(SpecModel):
    version: Literal[1] = Field(description="Schema version of this file.")
    org: Org
    teams: list[Team] = Field(min_length=1)

    def team(self, name: str) -> Team:
        return next(t for t in self.teams if t.name == name)

    def index(self, name: str) -> int:
        return next(i for i, t in enumerate(self.teams) if t.name == name)

    @property
    def shared(self) -> list[Team]:
        return [t for t in self.teams if t.placement == "shared"]




def load(root: Path, name: str = REGISTRY) -> Registry:
    """The registry at `root/name`, checked against the catalog and the stack files beside it;
    RegistryError lists every problem. Read at the edge (`make teams`, the program, the plan) and
    handed down."""
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()):  # a link out of the project (kubernetes.queues)
        raise RegistryError([Problem(name, f"leads out of the project (to {path.resolve()}); keep the registry in "
                                           "the project")], name)
    try:
        data = yamlread.load(read_text(path))  # as stack files are read: merge keys, no key twice, bounded
    except StackFileError as exc:
        missing = not path.exists() and not path.is_symlink()
        raise RegistryError([Problem(name, "cannot be read (No such file or directory); create it (docs/teams.md)"
                                     if missing else str(exc).removeprefix(name).lstrip(": "))], name) from None
    except yamlread.YamlError as exc:
        at = f"line {exc.line}: " if exc.line is not None else ""
        raise RegistryError([Problem(name, f"{at}{exc}")], name) from None
    if not isinstance(data, dict):
        raise RegistryError([Problem(name, "must be a mapping with version: 1, org and teams (docs/teams.md)")], name)
    try:
        registry = Registry.model_validate(data)
    except ValidationError as exc:
        raise RegistryError(problems_of(exc, Registry), name) from None
    problems = list(check(registry, root))
    if problems:
        raise RegistryError(problems, name)
    return registry


def check(registry: Registry, root: Path) -> Iterator[Problem]:
    """Rules across teams and against the org and the catalog."""
    seen: dict[str, int] = {}
    for i, team in enumerate(registry.teams):
        if team.name in seen:
            yield Problem(f"teams[{i}].name", f"{team.name!r} is already teams[{seen[team.name]}]; names are unique")
        seen.setdefault(team.name, i)
        yield from _check_team(registry, team, i)
    yield from _check_org_totals(registry)
    yield from _check_org_models(registry)
    project = functools.cache(lambda: project_name(root))  # Pulumi.yaml read once, if a stack file is
    yield from _check_stacks(registry, root, project)
    yield from _check_buckets(registry, root, project)


def _stack_value(root: Path, project: Callable[[], str], stack: str, key: str) -> Any:
    """One project key of a stack file, read as the Pulumi CLI hands it to the program (None
    where it is absent or the file unreadable: the stack's own plan says why)."""
    try:
        values = read_stack_file(root / f"Pulumi.{stack}.yaml", project()).values
    except StackFileError:
        return None
    return decode({k.split(":", 1)[1]: v for k, v in values.items() if k.startswith(f"{project()}:")}).get(key)


def _check_stacks(registry: Registry, root: Path, project: Callable[[], str]) -> Iterator[Problem]:
    """The base and shared stacks exist, and the shared one shares its clusters with this registry."""
    org = registry.org
    for key, stack in (("baseStack", org.base_stack), ("sharedStack", org.shared_stack)):
        if stack and not (root / f"Pulumi.{stack}.yaml").exists():
            yield Problem(f"org.{key}", f"no stack file Pulumi.{stack}.yaml here")
            return
    if registry.shared and not org.shared_stack:
        yield Problem("org.sharedStack", "shared teams need the stack whose clusters they queue on")
    elif org.shared_stack:
        access = _stack_value(root, project, org.shared_stack, "kubernetes")
        if not isinstance(access, dict) or access.get("queues") != REGISTRY:
            yield Problem("org.sharedStack", f"Pulumi.{org.shared_stack}.yaml does not set kubernetes.queues: "
                                             f"{REGISTRY}; point sharedStack at the stack whose clusters the teams share "
                                             "(or set it there)")


def _check_buckets(registry: Registry, root: Path, project: Callable[[], str]) -> Iterator[Problem]:
    """An isolated team's bucket prefix (<org>-<team>) fits 32 characters and is no other stack's:
    two stacks on one bucket would overwrite each other's checkpoints."""
    taken = {}
    for path in sorted(root.glob("Pulumi.*.yaml")):
        if is_generated(path):
            continue
        storage = _stack_value(root, project, path.name[len("Pulumi."):-len(".yaml")], "storage")
        if isinstance(storage, dict) and storage.get("bucketPrefix"):
            taken[str(storage["bucketPrefix"])] = path.name
    for i, team in enumerate(registry.teams):
        if team.placement != "isolated":
            continue
        prefix = bucket_prefix(registry, team)
        if len(prefix) > 32:
            yield Problem(f"teams[{i}].name", f"the team's bucket prefix {prefix!r} is over 32 characters; shorten "
                                              "the team name or org.name")
        elif prefix in taken:
            yield Problem(f"teams[{i}].name", f"the team's bucket prefix {prefix!r} is {taken[prefix]}'s; rename "
                                              "the team")
        taken.setdefault(prefix, f"team {team.name}")


def unreadable_stacks(root: Path) -> list[str]:
    """Why each stack file here cannot be read (a tag, a bad byte, a directory by that name):
    `make teams` goes on without them, as the bucket check above does, and says which."""
    out = []
    for path in sorted(root.glob("Pulumi.*.yaml")):
        try:
            read_stack_file(path, project_name(root))
        except StackFileError as exc:
            out.append(str(exc))
    return out


def bucket_prefix(registry: Registry, team: Team) -> str:
    return f"{registry.org.name}-{team.name}"


def _check_org_models(registry: Registry) -> Iterator[Problem]:
    catalog = cat.load_catalog()
    for cloud, quota in registry.org.gpus.items():
        models = catalog.gpu_models(cloud)
        for model in quota:
            if model not in models:
                yield Problem(f"org.gpus.{cloud}.{model}", f"{model} is not a GPU model of {cat.CLOUD_NAMES[cloud]} in "
                                                           f"the catalog; use one of {', '.join(models)}")


def _check_team(registry: Registry, team: Team, i: int) -> Iterator[Problem]:
    catalog = cat.load_catalog()
    for cloud in sorted(set(team.regions) | set(team.gpus)):
        if cloud not in registry.org.gpus:
            yield Problem(f"teams[{i}].gpus.{cloud}" if cloud in team.gpus else f"teams[{i}].regions.{cloud}",
                          f"team {team.name} asks for {cloud}, which the org does not use (org.gpus has "
                          f"{', '.join(registry.org.gpus)}); add it to org.gpus or remove it here")
    for cloud, regions in team.regions.items():
        for j, region in enumerate(regions):
            yield from check_region(cloud, region, f"teams[{i}].regions.{cloud}[{j}]")
    own = team.stack
    parts = [("networks", k, x.cloud) for k, x in enumerate(own.networks)] if own else []
    parts += [("nodeGroups", k, x.cloud) for k, x in enumerate(own.node_groups)] if own else []
    for key, k, cloud in parts:
        if cloud not in team.regions:
            yield Problem(f"teams[{i}].stack.{key}[{k}].cloud", f"team {team.name} has no {cloud} region; add "
                                                                 f"regions.{cloud} (and its quota) or use another cloud")
    for cloud, quota in team.gpus.items():
        if cloud not in team.regions:
            yield Problem(f"teams[{i}].gpus.{cloud}", f"team {team.name} has a {cloud} quota but no {cloud} region; "
                                                      f"add regions: {{{cloud}: [...]}}")
        models = catalog.gpu_models(cloud)
        for model in quota:
            if model not in models:
                yield Problem(f"teams[{i}].gpus.{cloud}.{model}",
                              f"{model} is not a GPU model of {cat.CLOUD_NAMES[cloud]} in the catalog; use one of "
                              f"{', '.join(models)}")


def _check_org_totals(registry: Registry) -> Iterator[Problem]:
    org = registry.org
    for cloud, quota in sorted(org_demand(registry).items()):
        for model, (asked, who) in sorted(quota.items()):
            has = quota_of(org.gpus, cloud).get(model, 0)
            if asked > has:
                yield Problem(f"org.gpus.{cloud}.{model}",
                              f"the teams ask for {asked} {model} GPUs on {cloud} ({who}), over the org's {has}; "
                              "lower the teams' quotas or raise the org's")
    budgets = sum(t.monthly_budget_usd for t in registry.teams)
    if budgets > org.monthly_budget_usd:
        who = ", ".join(f"{t.name} {t.monthly_budget_usd:,.0f}" for t in registry.teams)
        yield Problem("org.monthlyBudgetUsd", f"the teams' budgets add up to ${budgets:,.0f}/month ({who}), over the "
                                              f"org's ${org.monthly_budget_usd:,.0f}; lower them or raise the org's")


def org_demand(registry: Registry) -> dict[str, dict[str, tuple[int, str]]]:
    """cloud -> model -> (GPUs the teams ask for together, who asks)."""
    out: dict[str, dict[str, tuple[int, str]]] = {}
    for team in registry.teams:
        for cloud, quota in team.gpus.items():
            for model, gpus in quota.items():
                total, who = out.setdefault(cloud, {}).get(model, (0, ""))
                out[cloud][model] = (total + gpus, f"{who}, {team.name} {gpus}".lstrip(", "))
    return out
