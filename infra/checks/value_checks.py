"""Values each valid alone that do not work as a stack: a network on public addresses, a
checkpoint interval longer than the run. Called by infra/checks/validation.py with the other rules."""

from __future__ import annotations

from ipaddress import IPv4Network

from infra.core import catalog as cat
from infra.core.errors import Problem
from infra.model.spec import NodeGroup, StackSpec


def _cidr_problem(cloud: str, cidr: IPv4Network) -> str:
    """Why `cidr` cannot be a VPC on `cloud` ('' when it can): the ranges and their sources are
    data (data/constraints.yaml, vpcRanges)."""
    rule = dict(cat.load_constraints()["vpcRanges"])[cloud]
    allowed = [IPv4Network(r) for r in rule["allowed"]]
    if any(cidr.subnet_of(r) for r in allowed):
        return ""
    ranges = ", ".join(map(str, allowed))
    reserved = rule.get("reserved")
    if reserved and cidr.overlaps(IPv4Network(reserved["range"])):
        return f"{cidr} is in {reserved['range']}, which {cloud} does not take: {reserved['why']}; pick one of " \
               f"{ranges}, e.g. 10.0.0.0/16"
    return (f"{cidr} is not a private range for {cloud} ({ranges}); the internet hosts at those addresses would be "
            "unreachable from the nodes: pick a private range, e.g. 10.0.0.0/16")


def check(spec: StackSpec) -> list[Problem]:
    problems = []
    for i, net in enumerate(spec.networks):
        why = _cidr_problem(str(net.cloud), net.cidr)
        if why:
            problems.append(Problem(f"networks[{i}].cidr", why))
    every, steps = spec.training.checkpoint_every, spec.training.steps
    if isinstance(every, int) and every > steps:
        problems.append(Problem("training.checkpointEvery", f"{every} is above training.steps ({steps}): the run "
                                "would end before its first checkpoint and a reclaimed node would lose all of it; "
                                f"use at most {steps}, or auto"))
    return problems + _peer_problems(spec)


def run_nodes(group: NodeGroup) -> int:
    """The nodes of one run of a group: a VM group's scaling.max (its fleet is one elastic run), a
    Kubernetes group's Job's pods (scaling.desired, else min; infra/resolve/resolved.py)."""
    return group.scaling.max if group.kind == "vm" else max(1, group.scaling.baseline)


def _peer_problems(spec: StackSpec) -> list[Problem]:
    """The peer tier's settings where they cannot work: copies need another node of the run."""
    t, problems = spec.training, []
    if t.peer_every and not any(g.workload == "training" and run_nodes(g) > 1 for g in spec.node_groups):
        problems.append(Problem("training.peerEvery", "the peer tier copies each node's state to another node of the "
                                "run, and no training group here runs on more than one node: remove peerEvery, or "
                                "give a VM group scaling.max (a Kubernetes group scaling.desired) of 2 or more"))
    for name, value, default in (("peerHolders", t.peer_holders, 1), ("peerStoreGib", t.peer_store_gib, 0)):
        if value != default and not t.peer_every:
            problems.append(Problem(f"training.{name}", f"{value} is set while training.peerEvery is 0 (the peer tier "
                                    "is off), so it does nothing: set peerEvery too (e.g. 20), or remove it"))
    return problems
