"""What `pulumi destroy`, a refactor or a mistaken edit must not take: the stateful resources
(infra/data/stateful.yaml) are registered with `protect` — and buckets and keys also with
`retainOnDelete` — wherever the stack protects them (`protectStateful`, on by default in prod).

One stack transformation applies it to every resource the program registers, whichever module
creates it, so a new bucket or cluster cannot be forgotten; the policy pack checks the result."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pulumi

from infra.core import catalog as cat
from infra.model.spec import StackSpec


@dataclass(frozen=True)
class Stateful:
    type: str
    retain: bool
    why: str
    replace_on: tuple[str, ...]  # inputs the cloud cannot change in place


@functools.cache
def stateful_types() -> dict[str, Stateful]:
    data = cat.load_yaml("stateful.yaml")["types"]
    return {t: Stateful(t, bool(v["retain"]), str(v["why"]), tuple(v.get("replaceOn", ()))) for t, v in data.items()}


def protecting(spec: StackSpec) -> bool:
    return spec.protect_stateful if spec.protect_stateful is not None else spec.env == "prod"


def _protect(args: pulumi.ResourceTransformationArgs) -> pulumi.ResourceTransformationResult | None:
    found = stateful_types().get(args.type_)
    if found is None:
        # Pulumi hands `protect` down to children: a bucket's settings and its node-bundle object
        # (replaced whenever the bundle changes) must stay replaceable.
        if args.opts is not None and args.opts.protect is not None:
            return None
        return pulumi.ResourceTransformationResult(
            args.props, pulumi.ResourceOptions.merge(args.opts, pulumi.ResourceOptions(protect=False)))
    opts = pulumi.ResourceOptions.merge(args.opts, pulumi.ResourceOptions(
        protect=True, retain_on_delete=True if found.retain else None))
    return pulumi.ResourceTransformationResult(args.props, opts)


def register(spec: StackSpec) -> None:
    """Protect every stateful resource registered from here on (call before building)."""
    if protecting(spec):
        pulumi.runtime.register_stack_transformation(_protect)
