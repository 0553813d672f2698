"""The offline engine's fast paths (infra/plan/engine.py offline_fast_paths, issue 44): the SDK's
per-registration stack walk is skipped while a program runs here and restored after, the type
unwrapping is remembered per type without changing what it returns, and the plan is unchanged
(the golden plans check the bytes)."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import pulumi
import pulumi_random
import pytest
from pulumi import _types as pulumi_types
from pulumi.runtime import known_types, rpc
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import resource as pulumi_resource
from pulumi.runtime.proto import source_pb2

from infra.plan import engine
from infra.stack.stackfile import StackConfig


def test_the_stack_walk_is_skipped_while_a_program_runs_and_restored_after(monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[int] = []

    def spy() -> source_pb2.StackTrace:
        walks.append(1)
        return source_pb2.StackTrace()

    monkeypatch.setattr(pulumi_resource, "_get_stack_trace", spy)
    unwrap = pulumi_types.unwrap_type

    def program() -> None:
        pulumi_random.RandomPassword("pw", length=24, special=False)
        pulumi.CustomResource("bench:index:Resource", "plain", {"value": 1})

    found = engine.run_program(StackConfig(project="p", stack="s", values={}, secret_keys=[]), {}, program=program)
    assert {r.name for r in found} == {"pw", "plain"}
    assert walks == []  # not once per registration, not at all
    assert pulumi_resource._get_stack_trace is spy and pulumi_types.unwrap_type is unwrap  # restored
    password = next(r for r in found if r.name == "pw")
    assert password.inputs["length"] == 24 and password.inputs["special"] is False  # typed inputs as before


def test_remembered_unwrapping_returns_what_the_sdk_returns() -> None:
    remembered = engine._memo(pulumi_types.unwrap_type)
    types: list[Any] = [pulumi.Input[str], Optional[pulumi.Input[int]], pulumi.Output[list[str]],  # type: ignore[misc]
                        dict[str, Any], int]
    for typ in types:
        assert remembered(typ) == pulumi_types.unwrap_type(typ)
        assert remembered(typ) == pulumi_types.unwrap_type(typ)  # and from memory

    calls: list[object] = []

    def echo(value: Any) -> Any:
        calls.append(value)
        return value

    passed = engine._memo(echo)
    unhashable: list[int] = [1]
    assert passed(unhashable) is unhashable and passed(unhashable) is unhashable
    assert len(calls) == 2  # an unhashable value is passed through each time, never remembered
    assert passed("a") == "a" and passed("a") == "a" and len(calls) == 3


def _unknown() -> pulumi.Output[str]:
    """An input whose value the engine does not know (what a preview has before a create)."""
    value: Any = asyncio.Future()
    value.set_result("x")
    known: Any = asyncio.Future()
    known.set_result(False)
    return pulumi.Output(set(), value, known)


def _compared(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every registration's answer checked against `MockMonitor.RegisterResource`'s for the same
    request (asked first: the stock path decodes the request on its own); the names compared."""
    compared: list[str] = []
    lean = engine.CapturingMonitor._register

    def both(self: engine.CapturingMonitor, request: Any) -> Any:
        stock = pulumi_mocks.MockMonitor.RegisterResource(self, request)  # type: ignore[no-untyped-call]
        inputs, answer = lean(self, request)
        assert (answer.urn, answer.id) == (stock.urn, stock.id), request.name
        assert answer.object == stock.object, request.name
        compared.append(request.name)
        return inputs, answer

    monkeypatch.setattr(engine.CapturingMonitor, "_register", both)
    return compared


def test_the_engines_answer_is_the_mock_monitors_for_every_kind_of_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capturing monitor answers without decoding and encoding the whole state again where
    that gives the same message; for secrets (top level, in a list, in a map, a registry's password
    as the stack passes it), nulls in a map and a list, assets, archives, resource references,
    numbers, nesting, an id among the inputs, computed outputs and an unknown value, its answer is
    the one `MockMonitor.RegisterResource` gives for the same request."""
    compared = _compared(monkeypatch)
    seen: dict[str, Any] = {}

    def program() -> None:
        first = pulumi.CustomResource("bench:index:Resource", "plain", {
            "count": 3, "ratio": 0.5, "on": True, "none": None, "nested": {"a": [1, {"b": "c"}], "d": {}},
            "secret": pulumi.Output.secret("hidden"), "asset": pulumi.StringAsset("text"),
            "archive": pulumi.AssetArchive({"f": pulumi.StringAsset("x")})})
        computed = pulumi.CustomResource("bench:index:Computed", "computed", {"value": 1, "keep": "k", "result": None},
                                         opts=pulumi.ResourceOptions(depends_on=[first]))
        pulumi.CustomResource("bench:index:Resource", "ref", {"other": first, "id": "given-id"})
        pulumi.CustomResource("bench:index:Resource", "unknown", {"later": _unknown()})
        pulumi.CustomResource("bench:index:Resource", "nested", {
            "tags": {"a": pulumi.Output.secret("x"), "b": "y"}, "items": ["a", pulumi.Output.secret("x")],
            "cfg": {"a": None, "b": 1}, "list": [None, 1], "empty": {"l": [], "d": {}}, "big": 2**60 + 1,
            "registries": [{"address": "https://r.example", "username": "AWS", "password": pulumi.Output.secret("p")}]})
        pulumi.ComponentResource("bench:index:Component", "component", {"x": 1})
        pulumi.Output.all(computed.value, computed.result).apply(lambda v: seen.update(value=v[0], result=v[1]))  # type: ignore[attr-defined]

    computed = {"bench:index:Computed": lambda name, state: {"result": f"{name}-r", "value": state["value"] + 1}}
    found = engine.run_program(StackConfig(project="p", stack="s", values={}, secret_keys=[]), {}, computed,
                               program=program)
    assert sorted(compared) == ["component", "computed", "nested", "p-s", "plain", "ref", "unknown"]  # the stack too
    assert seen == {"value": 2, "result": "computed-r"}  # what the mock computed reached the program
    by_name = {r.name: r for r in found}
    assert rpc.is_rpc_secret(by_name["plain"].inputs["secret"])
    assert known_types.is_unknown(by_name["unknown"].inputs["later"])  # recorded as the engine got it
    assert by_name["ref"].inputs["id"] == "given-id"


def test_a_mock_that_answers_none_or_changes_the_inputs_gets_the_sdks_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A computed output of None leaves the input's value (the SDK's encoding leaves a None out),
    and a mock that changes a nested input in place changes the answer, never the inputs
    recorded as the engine received them."""
    compared = _compared(monkeypatch)
    seen: dict[str, Any] = {}

    def mutate(name: str, state: dict[str, Any]) -> dict[str, Any]:
        state["tags"]["managed-by"] = "provider"  # a provider's default tag
        return {"result": None, "extra": None}

    def program() -> None:
        made = pulumi.CustomResource("bench:index:Computed", "c", {"tags": {"a": "b"}, "result": "from-input"})
        pulumi.Output.all(made.result, made.tags).apply(  # type: ignore[attr-defined]
            lambda v: seen.update(result=v[0], tags=v[1]))

    found = engine.run_program(StackConfig(project="p", stack="s", values={}, secret_keys=[]), {},
                               {"bench:index:Computed": mutate}, program=program)
    assert sorted(compared) == ["c", "p-s"]
    assert seen == {"result": "from-input", "tags": {"a": "b", "managed-by": "provider"}}
    assert found[0].inputs["tags"] == {"a": "b"}
