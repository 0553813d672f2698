"""Checks of the training commands a stack gives its node groups (training.command,
nodeGroups[].training.command): what a command needs that the stack does not provide is named
before anything is created, not found by a crash loop on the nodes. (Images are checked with the
stack's own in infra/checks/cloud_rules.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator

from infra.core.errors import Problem
from infra.model.spec import StackSpec
from infra.resolve.groups import ResolvedGroup, Stack
from training import contract as c

MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# A contract variable the stack may leave empty for a group, and the setting that fills it.
FILLED_BY = {
    c.DATA_DIR.name: "training.dataset (nothing is cached into DATA_DIR without one)",
    c.DATASET_URL.name: "training.dataset",
    c.RDZV_ENDPOINT.name: "a scaling.max above 1 (a single-node group has no rendezvous)",
    c.MLFLOW_TRACKING_URI.name: "training.mlflowTrackingUri",
    c.AWS_REGION.name: "an AWS node group (it is empty on other clouds)",
    c.SHARED_DIR.name: "sharedFs: true on the group and a sharedFs on its network",
    c.NODE_RANK.name: "a Kubernetes group (the Job sets it; on VMs torchrun assigns ranks itself)",
    c.SPARES.name: "a Kubernetes group (the Job sets it)",
}


def _command_key(spec: StackSpec, rg: ResolvedGroup) -> str:
    own = rg.group.training is not None and rg.group.training.command
    return f"nodeGroups[{rg.index}].training.command" if own else "training.command"


def _command(spec: StackSpec, rg: ResolvedGroup) -> Iterator[Problem]:
    command = spec.command_of(rg.group)
    if not command:
        return
    key = _command_key(spec, rg)
    if command[0] == "-m" and (len(command) < 2 or not MODULE.match(command[1])):
        yield Problem(f"{key}[1]", "after '-m' comes a Python module name (e.g. my_project.train)")
    elif command[0].startswith("-") and command[0] != "-m":
        yield Problem(f"{key}[0]", f"{command[0]!r}: the command starts with a script (train.py), '-m module' or an "
                                   "executable; interpreter options do not reach python through the launchers")
    for i, arg in enumerate(command):
        for name in c.REFERENCE.findall(arg):
            if name not in c.NAMES:
                yield Problem(f"{key}[{i}]", f"${{{name}}} is not a trainer-contract variable, so it stays as "
                                             f"written; use one of {', '.join(sorted(c.NAMES))}")
            elif _left_empty(spec, rg, name):
                yield Problem(f"{key}[{i}]", f"{rg.name}'s command uses ${{{name}}}, which the stack leaves empty "
                                             f"for this group; it needs {FILLED_BY.get(name, 'a value for it')}")


def _left_empty(spec: StackSpec, rg: ResolvedGroup, name: str) -> bool:
    if name in (c.NODE_RANK.name, c.SPARES.name):  # the Job's completion index, its spare pods
        return rg.kind != "kubernetes"
    if name == c.RDZV_ENDPOINT.name:  # VMs: the network's store; Kubernetes: the Job's own store Service
        return rg.max_nodes <= 1
    if name == c.DATA_DIR.name:  # always a path, but an empty one without a dataset
        return not spec.training.dataset
    return not rg.trainer.get(name)


def check(stack: Stack) -> list[Problem]:
    """The problems of a spec that is otherwise valid, against its resolved groups."""
    problems: list[Problem] = []
    for rg in stack.groups:
        problems += [p for p in _command(stack.spec, rg) if p not in problems]
    return problems
