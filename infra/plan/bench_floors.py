"""The limits the offline plan's figures stand beside (infra/plan/bench.py), each run as a script in a
fresh process: the trivial floor (as many two-property resources as the plan has), and the floors
with the plan's own payload, replayed from what the plan registered: untyped, typed (through the
SDK's class of each type, flat) and structured (typed, with the plan's parents, providers,
dependencies and options). The plan's per-resource slope over the structured floor's is the stack
program's own code, the policy pack and the rendering, plus the SDK's and engine's work on what this
floor still leaves out: components' register_outputs, inputs passed as Outputs (their property
dependencies), invokes and secrets (about 2-4 % of the floor per resource, measured by reading the
requests; issue 44)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import keyword
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi

from infra import clouds

# The Python package behind each provider prefix of a resource type.
SDKS = {**{p.provider: p.sdk_package for p in clouds.profiles()}, "kubernetes": "pulumi_kubernetes",
        "docker-build": "pulumi_docker_build", "random": "pulumi_random"}


def sdk_modules(types: set[str]) -> list[str]:
    """The SDK modules a set of resource types needs: `aws:ec2/instance:Instance` ->
    pulumi_aws.ec2, `tencentcloud:As/scalingGroup:ScalingGroup` -> tencentcloud_iac_pulumi.as_,
    a Kubernetes resource to the module of its API version, which holds its class
    (`kubernetes:batch/v1:Job` -> pulumi_kubernetes.batch.v1: importing pulumi_kubernetes.batch
    alone leaves v1 unloaded), a custom resource (`kubernetes:kueue.x-k8s.io/v1beta1:ClusterQueue`)
    -> pulumi_kubernetes.apiextensions."""
    found = set()
    for token in types:
        pkg, module = token.split(":")[:2]
        if pkg not in SDKS:
            continue
        name = module.split("/")[0].split(".")[0].lower()
        if name == "index":
            found.add(SDKS[pkg])
            continue
        name = name + "_" if keyword.iskeyword(name) else name
        candidate = f"{SDKS[pkg]}.{name}"
        if importlib.util.find_spec(candidate) is None and pkg == "kubernetes":
            candidate = "pulumi_kubernetes.apiextensions"
        elif pkg == "kubernetes" and "/" in module:
            version = module.split("/")[1]
            if importlib.util.find_spec(f"{candidate}.{version}") is not None:
                candidate = f"{candidate}.{version}"
        found.add(candidate)
    return sorted(found)


_FLOOR = """
import importlib, sys, time
import pulumi
from infra.plan.engine import run_program
from infra.stack.stackfile import StackConfig
for sdk in sys.argv[2:]:
    getattr(importlib.import_module(sdk), "_load_", None)  # an attribute: the SDK's lazy module loads
count = int(sys.argv[1])
start = time.perf_counter()

def program():
    for i in range(count):
        pulumi.CustomResource("bench:index:Resource", f"r{i}", {"value": i, "name": f"r{i}"})

run_program(StackConfig(project="bench", stack="bench", values={}, secret_keys=[]), {}, program=program)
print(f"GTS_WORK_S={time.perf_counter() - start:.6f}", file=sys.stderr)
"""


# The floors with the plan's own payload: the resources the plan's program registered (`records`:
# type, name, inputs as recorded, links and options), registered again through the same engine with
# nothing computed and no program. The trivial floor's resources carry two properties; the plan's
# about thirty, and their outputs come back through the engine too. The replay floor registers them
# untyped and flat: the engine's work on the same bytes. The typed floor builds each through the
# SDK's own class for its type (the class's constructor, its declared outputs, its secrets), with
# the recorded inputs as its arguments, still flat. The structured floor adds each resource's
# recorded parent, provider, dependencies and options: what the plan costs beyond it is mostly the
# program's own work (the module docstring lists what it leaves out; issue 44).
_REPLAY = """
import importlib, json, sys, time
from infra.plan.bench_floors import replay_program
from infra.plan.engine import run_program
from infra.stack.stackfile import StackConfig
for sdk in sys.argv[3:]:
    getattr(importlib.import_module(sdk), "_load_", None)
with open(sys.argv[1], encoding="utf-8") as fh:
    resources = json.load(fh)
program = replay_program(resources, typed=sys.argv[2] != "replay", structured=sys.argv[2] == "structured")  # found first
start = time.perf_counter()
print(len(run_program(StackConfig(project="bench", stack="bench", values={}, secret_keys=[]), {}, program=program)))
print(f"GTS_WORK_S={time.perf_counter() - start:.6f}", file=sys.stderr)
"""
PAYLOAD_FLOORS = (("replay", "untyped"), ("typed", "through the SDK's class of each type where it has one, no program"),
                  ("structured", "typed, with the plan's parents, providers, dependencies and options, no program"))
_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")


def sdk_class(token: str) -> tuple[type, set[str]] | None:
    """The SDK's resource class of a type token and its constructor's parameters, or None (a
    provider, whose inputs the plan records JSON-encoded; a Kubernetes custom resource of a CRD;
    a component)."""
    modules = sdk_modules({token})
    found = getattr(importlib.import_module(modules[0]), token.split(":")[2], None) if modules else None
    if not isinstance(found, type) or not issubclass(found, pulumi.CustomResource):
        return None
    own = {"self", "__self__", "resource_name", "opts", "__props__"}  # never a recorded input's name
    return found, set(inspect.signature(getattr(found, "_internal_init")).parameters) - own


class Replay:
    """A program that registers the plan's recorded resources again (replay_program); `calls` holds
    what each registration is made with: the class, its arguments and the record it links."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., object], tuple[object, ...], dict[str, Any], dict[str, Any]]] = []

    def __call__(self) -> None:
        made: dict[str, Any] = {}
        for make, args, kwargs, links in self.calls:
            if links:
                kwargs = {**kwargs, "opts": _options(links, made)}
            made[links.get("urn", "")] = make(*args, **kwargs)


def replay_program(resources: list[dict[str, Any]], typed: bool, structured: bool = False) -> Replay:
    """A program that registers the plan's recorded resources again, untyped or (`typed`) through
    each type's SDK class with the recorded inputs as its arguments; flat (no parents, providers or
    dependencies), or (`structured`, from `records`, typed) with each resource's recorded parent,
    provider, dependencies and options, as ResourceOptions naming the resources registered before
    it. The classes and arguments are found here, before the program runs (and before the bench's
    clock): the plan calls its constructors with its arguments already in hand."""
    classes: dict[str, tuple[type, set[str]] | None] = {}
    replay = Replay()
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(_linked_first(resources) if structured else resources):
        kind = r["type"]
        # flat, two resources of one type and name would collide; with their parents they do not
        name = r["name"] if structured or (kind, r["name"]) not in seen else f"{r['name']}-{i}"
        seen.add((kind, name))
        links = r if structured else {}
        if not r["provider"] and not kind.startswith("pulumi:"):
            replay.calls.append((pulumi.ComponentResource, (kind, name, r["inputs"]), {}, links))
            continue
        if structured and kind.startswith("pulumi:providers:"):  # a provider another resource names
            replay.calls.append((pulumi.ProviderResource, (kind.split(":")[2], name, r["inputs"]), {}, links))
            continue
        if typed and kind not in classes:
            classes[kind] = sdk_class(kind)
        found = classes.get(kind) if typed else None
        if found is None:
            replay.calls.append((pulumi.CustomResource, (kind, name, r["inputs"]), {}, links))
            continue
        cls, params = found
        kwargs = {}
        for key, value in (r["inputs"] or {}).items():
            py = _CAMEL.sub(r"_\1", key).lower()
            py = py if py in params else py + "_"  # a keyword: `from_`, `type_`
            if py not in params:
                raise SystemExit(f"typed floor: {kind} has no argument for input {key!r}")
            kwargs[py] = value
        replay.calls.append((cls, (name,), kwargs, links))
    return replay


def _links(r: dict[str, Any]) -> list[str]:
    """The URNs a record names: its parent, its provider (a reference is `urn::id`), its dependencies."""
    return [u for u in (r["parent"], r["provider"].rsplit("::", 1)[0], *r["options"]["dependencies"]) if u]


def _linked_first(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with every resource after what it names (run_program lists them by URN, not in
    the program's order). A link to a resource not recorded (other than the root stack) or a cycle
    stops the floor, named: it would otherwise be dropped without a word."""
    by_urn = {r["urn"]: r for r in resources}
    ordered: list[dict[str, Any]] = []
    placed: set[str] = set()
    open_: set[str] = set()  # expanded, not yet placed: on the current path
    for first in resources:
        stack = [(first, False)]
        while stack:
            node, ready = stack.pop()
            urn = node["urn"]
            if ready:
                open_.discard(urn)
                placed.add(urn)
                ordered.append(node)
                continue
            if urn in placed:
                continue
            if urn in open_:
                raise SystemExit(f"structured floor: {urn} is linked to itself through its links")
            open_.add(urn)
            stack.append((node, True))
            for u in _links(node):
                if u not in by_urn and "::pulumi:pulumi:Stack::" not in u:
                    raise SystemExit(f"structured floor: {urn} names {u}, which the plan did not register")
                if u in by_urn and u not in placed:
                    stack.append((by_urn[u], False))
    return ordered


def _options(r: dict[str, Any], made: dict[str, Any]) -> pulumi.ResourceOptions:
    """A recorded resource's links and options, naming the resources registered before it. No
    aliases: the recorded ones are what the SDK derives (its classes' own, a parent's), and the
    program passes none."""
    options = r["options"]
    return pulumi.ResourceOptions(
        parent=made.get(r["parent"]),  # None: the root stack
        provider=made[r["provider"].rsplit("::", 1)[0]] if r["provider"] else None,
        depends_on=[made[u] for u in options["dependencies"]] or None,
        protect=options["protect"], retain_on_delete=options["retainOnDelete"],  # explicit: children inherit
        delete_before_replace=options["deleteBeforeReplace"],
        ignore_changes=options["ignoreChanges"] or None, replace_on_changes=options["replaceOnChanges"] or None)


# What the plan's program registers, with each resource's links and options as the engine received
# them (the plan's JSON leaves the dependencies out): the payload of the replay floors.
_RECORD = """
import json, sys
from infra.plan.__main__ import registered
_, _, resources = registered(sys.argv[1])
json.dump([{"type": r.type, "name": r.name, "urn": r.urn, "parent": r.parent, "provider": r.provider,
            "custom": r.custom, "inputs": r.masked(), "options": r.options} for r in resources], sys.stdout)
"""


def records(stack: str, cwd: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """The resources `stack`'s program registers (run in `cwd`), as the replay floors take them."""
    done = subprocess.run([sys.executable, "-c", _RECORD, stack], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"the resources of {stack} could not be recorded ({done.returncode}): {done.stderr[-2000:]}")
    found = json.loads(done.stdout)
    assert isinstance(found, list)
    return found
