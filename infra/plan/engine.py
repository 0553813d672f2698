"""Run the stack program in Pulumi's mock engine and capture every registered resource.

This is the one harness the plan and the tests share. It reads a stack file the way the
Pulumi CLI does (project-namespaced keys, structured values passed to the program as JSON,
`secure:` values kept secret), runs `__main__.py`, and records each registration's type,
logical name, URN, parent and inputs exactly as the engine receives them (camelCase).
"""

from __future__ import annotations

import json
import runpy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await



def find_project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: cwd) holding Pulumi.yaml, as the CLI
    finds it; this checkout when there is none."""
    here = (start or Path.cwd()).absolute()
    for folder in (here, *here.parents):
        if (folder / "Pulumi.yaml").exists():
            return folder
    return Path(__file__).resolve().parents[2]


ROOT = find_project_root()
SECRET_MASK = "[secret]"


class UnmockedInvoke(LookupError):
    """The program called a provider function the offline plan has no answer for."""


class StackFileError(Exception):
    """The stack file cannot be read as Pulumi would read it."""


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

    @property
    def cloud(self) -> str:
        pkg = self.type.split(":", 1)[0]
        return "pulumi" if pkg == "pulumi" else pkg

    def masked(self) -> dict[str, Any]:
        return dict(mask_secrets(self.inputs))


def mask_secrets(value: Any) -> Any:
    if rpc.is_rpc_secret(value):
        return SECRET_MASK
    if isinstance(value, dict):
        return {k: mask_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    return value


def unwrap_secrets(value: Any) -> Any:
    if rpc.is_rpc_secret(value):
        return unwrap_secrets(rpc.unwrap_rpc_secret(value))
    if isinstance(value, dict):
        return {k: unwrap_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap_secrets(v) for v in value]
    return value


class CapturingMonitor(pulumi_mocks.MockMonitor):
    """MockMonitor that also records parent, provider and custom-ness of each registration."""

    def __init__(self, mocks: pulumi_mocks.Mocks):
        super().__init__(mocks)
        self.registered: list[Registered] = []
        self.outputs: dict[str, dict[str, Any]] = {}  # component URN -> register_outputs()

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        response = super().RegisterResource(request)  # type: ignore[no-untyped-call]
        if request.type != "pulumi:pulumi:Stack":
            inputs = rpc.deserialize_properties(request.object, keep_unknowns=True)
            self.registered.append(Registered(
                type=request.type, name=request.name, urn=response.urn, parent=request.parent,
                custom=bool(request.custom), provider=request.provider, inputs=dict(inputs)))
        return response

    def RegisterResourceOutputs(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        self.outputs[request.urn] = dict(rpc.deserialize_properties(request.outputs, keep_unknowns=True))
        return super().RegisterResourceOutputs(request)  # type: ignore[no-untyped-call]


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


# ---------------------------------------------------------------------------------------
# Reading stack files as the CLI does
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StackConfig:
    project: str
    stack: str
    values: dict[str, str]  # full key -> string as the program receives it
    secret_keys: list[str] = field(default_factory=list)


def project_name(root: Path = ROOT) -> str:
    data = yaml.safe_load((root / "Pulumi.yaml").read_text(encoding="utf-8"))
    return str(data["name"])


def available_stacks(root: Path = ROOT) -> list[str]:
    return sorted(p.name[len("Pulumi."):-len(".yaml")] for p in root.glob("Pulumi.*.yaml"))


def stack_path(stack: str, root: Path = ROOT) -> Path:
    """`Pulumi.<stack>.yaml`, or a StackFileError naming the stacks that exist."""
    path = root / f"Pulumi.{stack}.yaml"
    if not path.exists():
        raise StackFileError(f"no stack file {path.name}; stacks here: {', '.join(available_stacks(root))} "
                             f"(create Pulumi.{stack}.yaml or pass STACK=<one of them>)")
    return path


def read_stack_file(path: Path, project: str) -> StackConfig:
    """Turn `Pulumi.<stack>.yaml` into the config map the Pulumi CLI hands the program."""
    stack = path.name[len("Pulumi."):-len(".yaml")]
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise StackFileError(f"{path.name} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("config", {}), dict):
        raise StackFileError(f"{path.name}: expected a mapping with a 'config:' mapping")
    values: dict[str, str] = {}
    secrets: list[str] = []
    for key, value in (data.get("config") or {}).items():
        full = key if ":" in key else f"{project}:{key}"
        if isinstance(value, dict) and set(value) == {"secure"}:
            # Encrypted with the stack's key; the offline plan cannot and need not decrypt it.
            values[full] = SECRET_MASK
            secrets.append(full)
        elif isinstance(value, str):
            values[full] = value
        else:
            values[full] = json.dumps(value)
    return StackConfig(project, stack, values, secrets)


def run_program(config: StackConfig, invokes: Mapping[str, InvokeHandler],
                computed: Mapping[str, ComputedOutputs] | None = None,
                program: Callable[[], Any] | None = None) -> list[Registered]:
    """Run the stack program (default: `__main__.py`) under mocks; return what it registered.

    Exceptions from the program (a pulumi.RunError for a bad spec) propagate unchanged.
    """
    pulumi.runtime.set_all_config(config.values, config.secret_keys)
    monitor = CapturingMonitor(StackMocks(invokes, computed))
    pulumi.runtime.set_mocks(monitor.mocks, project=config.project, stack=config.stack,
                             preview=False, monitor=monitor)
    def main() -> None:
        if program is not None:
            program()
        else:
            runpy.run_path(str(ROOT / "__main__.py"), run_name="__main__")

    _sync_await(run_pulumi_func(main))
    for res in monitor.registered:
        res.outputs = monitor.outputs.get(res.urn, {})
    return monitor.registered
