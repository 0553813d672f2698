"""Run the stack program in Pulumi's mock engine and capture every registered resource.

This is the one harness the plan and the tests share. Given a stack's config as the Pulumi
CLI hands it over (`infra.stack.stackfile`), it runs `__main__.py` and records each registration's
type, logical name, URN, parent and inputs exactly as the engine receives them (camelCase).
"""

from __future__ import annotations

import runpy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from google.protobuf import struct_pb2
from pulumi import _types as pulumi_types
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import resource as pulumi_resource
from pulumi.runtime import rpc
from pulumi.runtime.proto import resource_pb2, source_pb2
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.stack.stackfile import SECRET_MASK, StackConfig, project_root


# What in a registration's encoded inputs the SDK's decoding changes, so that the mock engine's
# answer (the inputs decoded, then encoded again) is not the inputs' message: the wire's unknown
# value; a resource reference's mark (the mock answers a reference with the resource's id); a
# secret's mark (a secret inside a list or a map is lifted to wrap the whole property); a null
# inside a map (dropped: a Struct entry whose Value is null_value, `12 02 08 00`). Registrations
# carrying any of them take the SDK's own path.
_STOCK_ONLY = (rpc.UNKNOWN.encode(), rpc._special_resource_sig.encode(), rpc._special_secret_sig.encode(),
               b"\x12\x02\x08\x00")


class UnmockedInvoke(LookupError):
    """The program called a provider function the offline plan has no answer for."""


class DuplicateUrn(ValueError):
    """Two registrations share one URN: the engine refuses that at preview, so the plan does too."""


@dataclass
class Registered:
    """One resource registration as the engine saw it."""

    type: str
    name: str
    urn: str
    parent: str
    custom: bool
    provider: str
    inputs: dict[str, Any]  # secrets still wrapped; see masked()
    outputs: dict[str, Any] = field(default_factory=dict)  # what a component registered as outputs
    options: dict[str, Any] = field(default_factory=dict)  # resource options as the engine received them

    @property
    def cloud(self) -> str:
        pkg = self.type.split(":", 1)[0]
        return "pulumi" if pkg == "pulumi" else pkg

    def masked(self) -> dict[str, Any]:
        return dict(mask_secrets(self.inputs))


# Both walks below descend only into dicts and lists (a secret is a dict); a scalar is taken as it
# is without a call of its own: most of a resource's inputs are scalars (issue 44).
def mask_secrets(value: Any) -> Any:
    """`value` with each secret in it replaced by SECRET_MASK."""
    if isinstance(value, dict):
        if rpc.is_rpc_secret(value):
            return SECRET_MASK
        return {k: mask_secrets(v) if isinstance(v, (dict, list)) else v for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) if isinstance(v, (dict, list)) else v for v in value]
    return value


def unwrap_secrets(value: Any) -> Any:
    """`value` with each secret in it replaced by what it holds."""
    if isinstance(value, dict):
        if rpc.is_rpc_secret(value):
            return unwrap_secrets(rpc.unwrap_rpc_secret(value))
        return {k: unwrap_secrets(v) if isinstance(v, (dict, list)) else v for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap_secrets(v) if isinstance(v, (dict, list)) else v for v in value]
    return value


class CapturingMonitor(pulumi_mocks.MockMonitor):
    """MockMonitor that also records parent, provider and custom-ness of each registration."""

    def __init__(self, mocks: pulumi_mocks.Mocks):
        super().__init__(mocks)
        self.registered: list[Registered] = []
        self.urns: dict[str, Registered] = {}
        self.duplicates: list[str] = []
        self.outputs: dict[str, dict[str, Any]] = {}  # component URN -> register_outputs()

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        inputs, response = self._register(request)
        if response.urn in self.urns:
            first = self.urns[response.urn]
            self.duplicates.append(f"{request.type} '{request.name}' (under {request.parent or 'the stack'}) and "
                                   f"{first.type} '{first.name}' (under {first.parent or 'the stack'}) would both be "
                                   f"{response.urn}")
        if inputs is not None:
            options = _options(request)
            options["aliases"] = self._alias_urns(request, response.urn)
            self.registered.append(Registered(
                type=request.type, name=request.name, urn=response.urn, parent=request.parent,
                custom=bool(request.custom), provider=request.provider, inputs=dict(inputs), options=options))
            self.urns[response.urn] = self.registered[-1]
        return response

    def _register(self, request: Any) -> tuple[dict[str, Any] | None, Any]:
        """The registration's inputs (unknowns kept, None for the stack) and the engine's answer.

        The answer is `MockMonitor.RegisterResource`'s, built without its second decoding of the
        inputs and its encoding of the whole state again (through an event loop of its own in the
        executor's thread) where that encoding would give back the inputs' message unchanged: a
        resource whose mock only echoes its inputs (no computed outputs: `StackMocks.computed`)
        and whose inputs carry nothing the decoding changes (`_STOCK_ONLY`). Its answer is the
        inputs' message as the program encoded it, copied, with the id and ARN the mock adds.
        Issue 44: that pair cost about 0.25 ms of a resource's 2. Every other registration takes
        the SDK's own path."""
        if (request.type == "pulumi:pulumi:Stack" or type(self.mocks) is not StackMocks
                or request.type in self.mocks.computed
                or any(mark in request.object.SerializeToString() for mark in _STOCK_ONLY)):
            response = super().RegisterResource(request)  # type: ignore[no-untyped-call]
            inputs = (None if request.type == "pulumi:pulumi:Stack"
                      else rpc.deserialize_properties(request.object, keep_unknowns=True))
            return inputs, response
        inputs = rpc.deserialize_properties(request.object, keep_unknowns=True)
        urn = self.make_urn(request.parent, request.type, request.name)
        args = pulumi_mocks.MockResourceArgs(
            typ=request.type, name=request.name, inputs=inputs, provider=request.provider,
            resource_id=request.importId, custom=request.custom or False,
            transforms=pulumi_mocks._resolve_callbacks(request.transforms))
        id_, state = self.mocks.new_resource(args)
        state_proto = struct_pb2.Struct()
        state_proto.CopyFrom(request.object)
        added = {k: v for k, v in state.items() if k not in inputs or v is not inputs[k]}  # the id, the ARN
        if added:
            encoded = _sync_await(rpc.serialize_properties(added, {}))
            for key in added:
                if key in encoded.fields:  # the SDK's encoding leaves a None out
                    state_proto.fields[key].CopyFrom(encoded.fields[key])
        self.resources[urn] = pulumi_mocks.MockMonitor.ResourceRegistration(urn, id_ or "", state)
        return dict(inputs), resource_pb2.RegisterResourceResponse(urn=urn, id=id_ or "", object=state_proto)

    def _alias_urns(self, request: Any, urn: str) -> list[str]:
        """The URNs a resource was known by, as the engine derives them from the alias specs the
        SDK sends (and from its parent's aliases: children of a renamed component keep theirs)."""
        stack, project = urn.split("::")[0].rsplit(":", 1)[-1], urn.split("::")[1]
        found = list(request.aliasURNs)
        for alias in request.aliases:
            if alias.urn:
                found.append(alias.urn)
                continue
            spec = alias.spec
            parent = "" if spec.noParent else (spec.parentUrn or request.parent)
            found.append(_urn(spec.stack or stack, spec.project or project, parent, spec.type or request.type,
                              spec.name or request.name))
        parent_record = self.urns.get(request.parent)
        for parent_alias in parent_record.options["aliases"] if parent_record else []:
            name = request.name
            old_parent_name = parent_alias.rsplit("::", 1)[1]
            if parent_record and name.startswith(parent_record.name):  # the SDK's child-name rule
                name = old_parent_name + name[len(parent_record.name):]
            found.append(_urn(stack, project, parent_alias, request.type, name))
        return sorted(set(found) - {urn})

    def RegisterResourceOutputs(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        self.outputs[request.urn] = dict(rpc.deserialize_properties(request.outputs, keep_unknowns=True))
        return super().RegisterResourceOutputs(request)  # type: ignore[no-untyped-call]


def _urn(stack: str, project: str, parent: str, type_: str, name: str) -> str:
    """urn:pulumi:<stack>::<project>::<parent's type>$<type>::<name>, as the engine builds it."""
    qualified = f"{parent.split('::')[2].split('$')[-1]}${type_}" if parent else type_
    return f"urn:pulumi:{stack}::{project}::{qualified}::{name}"


def _options(request: Any) -> dict[str, Any]:
    """The resource options of a registration request that decide what `pulumi up` replaces,
    keeps or waits for."""
    return {"protect": bool(request.protect), "retainOnDelete": bool(request.retainOnDelete),
            "deleteBeforeReplace": bool(request.deleteBeforeReplace),
            "ignoreChanges": list(request.ignoreChanges), "replaceOnChanges": list(request.replaceOnChanges),
            "dependencies": sorted(request.dependencies), "aliases": sorted(request.aliasURNs)}


InvokeHandler = Callable[[dict[str, Any]], dict[str, Any]]
ComputedOutputs = Callable[[str, dict[str, Any]], dict[str, Any]]


class StackMocks(pulumi_mocks.Mocks):
    """Resource outputs echo the inputs plus an id; invokes need an explicit handler."""

    def __init__(self, invokes: Mapping[str, InvokeHandler],
                 computed: Mapping[str, ComputedOutputs] | None = None):
        self.invokes = dict(invokes)
        self.computed = dict(computed or {})

    def new_resource(self, args: pulumi_mocks.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        state = dict(args.inputs)
        extra = self.computed.get(args.typ)
        if extra is not None:
            state.update(extra(args.name, state))
        rid = str(state.get("id") or f"{args.name}-id")
        state.setdefault("id", rid)
        state.setdefault("arn", f"arn:mock:{args.typ}:{args.name}")
        return rid, state

    def call(self, args: pulumi_mocks.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        handler = self.invokes.get(args.token)
        if handler is None:
            raise UnmockedInvoke(f"no mock for invoke {args.token}; add one in infra/plan/invokes.py")
        return handler(dict(args.args)), []


def _memo(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`fn` of a type, remembered per type (a type that cannot be hashed is passed through)."""
    seen: dict[Any, Any] = {}

    def remembered(val: Any) -> Any:
        try:
            return seen[val]
        except KeyError:
            seen[val] = found = fn(val)
            return found
        except TypeError:
            return fn(val)
    return remembered


@contextmanager
def offline_fast_paths() -> Iterator[None]:
    """Work of the SDK that the mock engine does not need, or need again, skipped while a program
    runs here (issue 44: a resource cost the plan about 3 ms against 1.3 ms for the engine
    registering the same inputs untyped):
    - `_get_stack_trace`: at every registration the SDK walks the whole Python stack (a frame
      summary, a source line read and a file URI per frame) to tell the engine where the resource
      was declared. The mock monitor never reads it; with the stack's components nesting resources
      ten frames deep it cost about 0.8 ms a resource.
    - `unwrap_type` / `unwrap_optional_type`: pure functions of a property's type annotation,
      recomputed through `typing.get_origin` for every property of every typed resource's
      inputs and outputs; remembered per type for the run.
    Offline only: `pulumi up` runs the program under the CLI, never through this harness."""
    patches = [(pulumi_resource, "_get_stack_trace", source_pb2.StackTrace),
               (pulumi_types, "unwrap_type", _memo(pulumi_types.unwrap_type)),
               (pulumi_types, "unwrap_optional_type", _memo(pulumi_types.unwrap_optional_type))]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def run_program(config: StackConfig, invokes: Mapping[str, InvokeHandler],
                computed: Mapping[str, ComputedOutputs] | None = None,
                program: Callable[[], Any] | None = None, root: Path | None = None) -> list[Registered]:
    """Run the stack program (default: `__main__.py`) under mocks; return what it registered.

    Exceptions from the program (a pulumi.RunError for a bad spec) propagate unchanged.
    """
    # A fresh root stack resource per run: it carries the program's stack transformations
    # (infra/render/protection.py), which must not leak into the next run in this process.
    pulumi.runtime.settings.reset_options(project=config.project, stack=config.stack)
    pulumi.runtime.set_all_config(config.values, config.secret_keys)
    monitor = CapturingMonitor(StackMocks(invokes, computed))

    def main() -> None:
        if program is not None:
            program()
        else:
            runpy.run_path(str((root or project_root()) / "__main__.py"), run_name="__main__")

    with offline_fast_paths():  # the root stack resource registers in set_mocks
        pulumi.runtime.set_mocks(monitor.mocks, project=config.project, stack=config.stack,
                                 preview=False, monitor=monitor)
        _sync_await(run_pulumi_func(main))
    if monitor.duplicates:
        raise DuplicateUrn("two resources would have one name (Pulumi refuses this at preview): "
                           + "; ".join(monitor.duplicates) + ". Rename one of the spec entries behind them")
    for res in monitor.registered:
        res.outputs = monitor.outputs.get(res.urn, {})
    # Registration order follows the event loop's scheduling; URN order is the same every run.
    return sorted(monitor.registered, key=lambda r: r.urn)
