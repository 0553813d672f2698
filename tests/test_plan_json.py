"""The plan's JSON (infra/plan/plan_json.py) is Python's `json.dumps(plan, indent=2)` byte for byte,
on the stacks' real plans and on hostile values, and takes orjson's path on the real plans."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import random
import struct
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from infra.plan import plan_json
from infra.plan.__main__ import build_plan


def _python(value: Any) -> str:
    return json.dumps(value, indent=2)


@pytest.fixture(scope="module")
def dev_plan() -> dict[str, Any]:
    return build_plan("dev")


def test_a_real_plan_is_the_same_bytes_on_the_fast_path(dev_plan: dict[str, Any]) -> None:
    assert plan_json.dumps(dev_plan) == _python(dev_plan)
    raw = orjson.dumps(dev_plan, option=plan_json._OPTIONS)  # orjson takes it, subclasses and all
    # The plan holds text beyond ASCII (an em dash in a node script) and names such as
    # `...-scrape-0-9100`: neither sends it to Python's encoder.
    assert not raw.isascii()
    assert not plan_json._small_float(raw)


TEXT = "".join(chr(c) for c in range(0x800)) + "\u2028\u2029\ufeff\uffff\U0001f600\U0010ffff"


@pytest.mark.parametrize("value", [
    {TEXT: [TEXT, {"k\x7f": "é"}], "empty": [[], {}], "none": None, "flags": [True, False]},
    {"big": [2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**40]},  # orjson refuses beyond 64 bits
    {1: "a", 2.5: "b", None: "c", False: "d"},  # keys that are not text
    {"lone": "\ud800"},  # a lone surrogate
    {"tuple": (1, (2, "x")), "nested": [[[[]]]]},
    {"small": [1e-5, 5.98e-8, -1.2e-7, 0.00001799, 1e-300, 5e-324, -0.0, 0.0001, 0.00012, 1e16, 1.5e300]},
    {"text": ["scrape-0-9100", "8eb10072-bd79-6e2e-7a09", "ratio: 1e-5", "0.00001", "-0.00002", "v0.00001"]},
    [1e-5], 1e-5, "0.00001", "e-5", [], {}, "", 0, 1.5,
])
def test_hostile_values_are_the_same_bytes(value: Any) -> None:
    assert plan_json.dumps(value) == _python(value)


class Reordered(collections.OrderedDict[str, int]):
    pass


class Backwards(list[int]):
    def __iter__(self) -> Iterator[int]:
        return reversed(list(super().__iter__()))


def test_subclasses_are_written_through_their_own_methods() -> None:
    moved = collections.OrderedDict(a=1, b=2)
    moved.move_to_end("a")
    for value in ({"x": moved}, [Backwards([1, 2, 3])], {"r": Reordered(b=1, a=2)}):
        assert plan_json.dumps(value) == _python(value)


@pytest.mark.parametrize("value", [{"d": dataclasses.make_dataclass("D", ["a"])(1)}, [datetime.date(2026, 12, 4)]])
def test_what_python_refuses_is_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        plan_json.dumps(value)


def test_random_floats_are_the_same_bytes() -> None:
    rng = random.Random(44)
    for _ in range(3000):
        pick = rng.random()
        if pick < 0.4:
            x = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
            if x != x or abs(x) == float("inf"):
                continue
        elif pick < 0.8:
            x = rng.choice((1, -1)) * 10 ** rng.uniform(-320, 308)
        else:
            x = round(rng.uniform(-1000, 1000), rng.randint(0, 12))
        value = {"a": [x, {"b": x}], "c": x}
        assert plan_json.dumps(value) == _python(value), repr(x)


def test_small_floats_are_found_as_numbers_only() -> None:
    def raw(value: Any) -> bytes:
        return orjson.dumps(value, option=orjson.OPT_INDENT_2)

    assert plan_json._small_float(raw([1e-5])) and plan_json._small_float(raw({"x": -5.98e-8}))
    assert plan_json._small_float(raw(1e-6))
    assert not plan_json._small_float(raw(["scrape-0-9100", "6e2e-7a09", "a0.00001", 10.00001, 1e-10]))


def test_nan_is_written_as_null() -> None:
    # The one difference kept (the module says why): JSON has no NaN.
    assert plan_json.dumps([float("nan"), float("inf")]) == "[\n  null,\n  null\n]"
