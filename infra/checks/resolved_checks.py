"""The checks that need the node groups resolved (instance types picked, priced, their fabric
and trainer contract set): a spot cap far under the market, a RAM cache the nodes cannot hold,
warm spares where they cannot work (infra/resolve/spares.py), each group's fabric, the commands against the trainer contract, and a shared stack's teams'
queues against its pools. The groups are resolved once here and the stack handed back to the
caller (infra/checks/validation.py parse_stack), which hands it on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from infra.checks import commands
from infra.core.catalog import to_usd
from infra.core.errors import Problem
from infra.model.spec import StackSpec
from infra.resolve import fabric_plan, spares
from infra.resolve.groups import Stack, resolve
from infra.teams import queues
from infra.teams.registry import Registry, RegistryError

# The edge's reader of the team registry a stack names (kubernetes.queues): file name -> registry,
# RegistryError when it cannot be read or is invalid (infra/stack/stackfile.py teams_reader).
TeamsReader = Callable[[str], Registry]


def check(spec: StackSpec, teams: TeamsReader | None,
          declared: StackSpec | None = None) -> tuple[Stack, list[Problem]]:
    """The spec's groups resolved, and their problems (each step only when the ones before found none).
    `declared`: the spec before its groups were placed at their activeCandidate (infra/capacity)."""
    stack = replace(resolve(spec), declared=declared or spec)
    problems = _check_workable(stack)
    if not problems:  # each group's fabric against its resolved types (infra/fabric.py)
        problems += fabric_plan.check(spec)
    if not problems:  # the commands are checked against the resolved groups' trainer contract
        problems += commands.check(stack)
    if not problems and spec.kubernetes.queues:  # the teams' queues against the resolved pools
        registry, found = _shared_registry(stack, teams)
        problems += found
        stack = replace(stack, teams=registry)  # handed on: the clusters' queues are built from it
    return stack, problems


def check_shared_stack(stack: Stack, teams: TeamsReader | None) -> list[Problem]:
    """A stack with kubernetes.queues: its registry loads, names this stack as the shared one, and
    its shared teams' quotas fit the stack's GPU pools (infra/teams/queues.py)."""
    return _shared_registry(stack, teams)[1]


def _shared_registry(stack: Stack, teams: TeamsReader | None) -> tuple[Registry | None, list[Problem]]:
    """check_shared_stack's problems, and the registry when it could be read."""
    name = stack.spec.kubernetes.queues
    assert name is not None  # called for a stack with kubernetes.queues
    if teams is None:
        return None, [Problem("kubernetes.queues", f"{name}: the team registry was not read (the caller reads it "
                                                   "once and hands it to the check: infra/stack/stackfile.py teams_reader)")]
    try:
        registry = teams(name)
    except RegistryError as exc:
        return None, [Problem("kubernetes.queues", f"{name}: {p}") for p in exc.problems]
    return registry, [Problem("kubernetes.queues", f"{name}: {p}") for p in queues.check(stack, registry)]


# A spot cap under this share of the spot price the catalog expects gets no capacity: spot prices
# move around the typical discount, not to a fraction of it.
SPOT_CAP_FLOOR = 0.5


def _check_workable(stack: Stack) -> list[Problem]:
    """Values that pass every range check but cannot work, refused with the arithmetic: a spot
    cap far under the market, a RAM cache (storage.datasetTmpfsGb) the nodes cannot hold next to
    the trainer."""
    spec = stack.spec
    out: list[Problem] = []
    rate = spec.pricing.cny_per_usd
    tmpfs = spec.storage.dataset_tmpfs_gb
    catalog = spec.catalog()
    for rg in stack.groups:
        out += spares.problems(rg)
        cap = rg.market.spot_max_price_usd
        if rg.spot and cap is not None:
            item = rg.primary
            on_demand = to_usd(item.price_ondemand, item.currency, rate)
            market = on_demand * (1 - item.spot_discount)
            if cap < SPOT_CAP_FLOOR * market:
                out.append(Problem(f"{rg.path}.market.spotMaxPriceUsd",
                                   f"${cap:g}/h is far below the spot price of {item.instance_type} in {rg.region}: "
                                   f"${on_demand:.4f}/h on-demand x (1 - {item.spot_discount:g} typical spot discount) "
                                   f"= ${market:.4f}/h; under {SPOT_CAP_FLOOR:g} x that (${SPOT_CAP_FLOOR * market:.4f}/h) "
                                   "the group would never get capacity: raise it, or leave it out (up to on-demand)"))
        if tmpfs:
            for itype in rg.types:
                node = catalog.priced(rg.cloud, itype, rg.region)
                if node is None:
                    continue
                room = node.ram_gib - node.total_vram_gb  # the trainer keeps about its GPUs' memory in RAM
                if tmpfs > room:
                    out.append(Problem("storage.datasetTmpfsGb",
                                       f"{tmpfs} GB of RAM cache does not fit node group {rg.name}'s {itype}: "
                                       f"{node.ram_gib} GiB RAM - {node.total_vram_gb} GB for the trainer (its GPUs' "
                                       f"memory) = {max(room, 0)} GB at most; lower it or set 0 (off)"))
                    break
    return out
