"""The offline engine's fast paths (infra/plan/engine.py offline_fast_paths, issue 44): the SDK's
per-registration stack walk is skipped while a program runs here and restored after, the type
unwrapping is remembered per type without changing what it returns, and the plan is unchanged
(the golden plans check the bytes)."""

from __future__ import annotations

from typing import Any, Optional

import pulumi
import pulumi_random
import pytest
from pulumi import _types as pulumi_types
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
