"""Values each valid alone that do not work as a stack: a network on public addresses, a
checkpoint interval longer than the run. Called by infra/validation.py with the other rules."""

from __future__ import annotations

from ipaddress import IPv4Network

from infra.errors import Problem
from infra.spec import StackSpec

# RFC 1918's private ranges: a VPC on any other range hides the internet hosts at those addresses
# from its own nodes (their traffic stays in the VPC), and no cloud routes them.
RFC1918 = tuple(IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))


def check(spec: StackSpec) -> list[Problem]:
    problems = []
    for i, net in enumerate(spec.networks):
        if not any(net.cidr.subnet_of(r) for r in RFC1918):
            problems.append(Problem(f"networks[{i}].cidr", f"{net.cidr} is not a private range (RFC 1918: "
                                    f"{', '.join(map(str, RFC1918))}); the internet hosts at those addresses would "
                                    "be unreachable from the nodes: pick a private range, e.g. 10.0.0.0/16"))
    every, steps = spec.training.checkpoint_every, spec.training.steps
    if isinstance(every, int) and every > steps:
        problems.append(Problem("training.checkpointEvery", f"{every} is above training.steps ({steps}): the run "
                                "would end before its first checkpoint and a reclaimed node would lose all of it; "
                                f"use at most {steps}, or auto"))
    return problems
