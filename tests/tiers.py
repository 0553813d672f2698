"""The two test tiers: `make test` runs every test; `make test-fast` runs the ones marked neither
`slow` nor `boot`: tests that start no process, plan no whole stack under Pulumi's mocks and boot
no node.

A test is marked `slow` by rule (tests/conftest.py calls `mark`), not by hand: when it or a
fixture it uses names, in its code or in the code of the tests/ helpers it calls (followed all
the way), a process or a whole-stack plan: the subprocess and multiprocessing modules, os.fork
and its kin, the mock engine's `run_program` or the plan's `build_plan`. What the rule cannot
see (project code a test calls that starts a process itself) is listed in SLOW. The rule errs
towards slow: a test that names such a helper without calling it is slow too. Under
`make test-fast` (GTS_TEST_TIER=fast) `guard` makes starting a process or planning a stack fail
the test that does it, naming what it started, so a test the rule misses is found, not hidden.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

TIER_ENV = "GTS_TEST_TIER"
SLOW_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing", "pty", "asyncio.subprocess"})
SLOW_CALLABLES = frozenset({("infra.plan.engine", "run_program"), ("infra.plan.__main__", "build_plan"),
                            ("infra.plan.__main__", "main"), ("posix", "fork"), ("posix", "system"),
                            ("posix", "posix_spawn"), ("posix", "posix_spawnp"), ("posix", "forkpty"),
                            ("asyncio.subprocess", "create_subprocess_exec"),
                            ("asyncio.subprocess", "create_subprocess_shell")})
# Tests the rule cannot see as slow: they call project code that starts processes or plans
# stacks itself (file name -> test function names; every test of the file when empty).
SLOW: dict[str, frozenset[str]] = {
    "test_bench.py": frozenset({"test_the_plan_group_scales_the_stack_and_rotates_every_run"}),  # infra/plan/bench.py
}


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _is_slow_object(obj: Any) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__ in SLOW_MODULES
    return (getattr(obj, "__module__", None), getattr(obj, "__name__", None)) in SLOW_CALLABLES


def _ours(obj: Any) -> bool:
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "") or ""
    return module == "tests" or module.startswith("tests.") or module == "conftest"


def _module(name: str) -> types.ModuleType | None:
    """A module a function imports inside itself (its dotted name is among the code's names)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _functions(obj: Any) -> list[types.FunctionType]:
    """The functions behind a test helper: itself, a class's methods, a fixture's wrapped function."""
    wrapped = getattr(obj, "__pytest_wrapped__", None)
    obj = inspect.unwrap(wrapped.obj if wrapped is not None else obj)
    if isinstance(obj, type):
        return [inspect.unwrap(f) for f in vars(obj).values() if isinstance(inspect.unwrap(f), types.FunctionType)]
    return [obj] if isinstance(obj, types.FunctionType) else []


@functools.cache
def slow_code(func: types.FunctionType) -> bool:
    """Whether a function, or a tests/ helper it names (followed through), names a slow root."""
    return _slow(func, set())


def _slow(func: types.FunctionType, seen: set[int]) -> bool:
    if id(func) in seen:
        return False
    seen.add(id(func))
    names = set(_code_names(func.__code__))
    if names & SLOW_MODULES:  # `import subprocess` inside the function
        return True
    refs = [func.__globals__[n] for n in names if n in func.__globals__]
    refs += [_module(n) for n in names if n in sys.modules or n.startswith(("tests.", "infra.plan"))]
    refs += [getattr(m, n) for m in refs if isinstance(m, types.ModuleType) for n in names if hasattr(m, n)]
    for ref in refs:
        if _is_slow_object(ref):
            return True
        if _ours(ref) and not isinstance(ref, types.ModuleType):
            if any(_slow(f, seen) for f in _functions(ref)):
                return True
    return False


def is_slow(item: pytest.Item) -> bool:
    if item.get_closest_marker("boot"):
        return True
    listed = SLOW.get(item.path.name)
    if listed is not None and (not listed or getattr(item, "originalname", item.name) in listed):
        return True
    func = getattr(item, "function", None)
    if isinstance(func, types.FunctionType) and slow_code(func):
        return True
    defs: dict[str, Any] = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in defs.get(name, ()):
            if _ours(fixturedef.func) and any(slow_code(f) for f in _functions(fixturedef.func)):
                return True
    return False


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


class FastTierError(AssertionError):
    """A test in the fast tier started a process or planned a whole stack."""


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise FastTierError(f"the fast tier (make test-fast) runs no {what}: this test is slow; add it to SLOW "
                            "in tests/tiers.py or make the rule see it")
    return refused


def guard() -> None:
    """Under GTS_TEST_TIER=fast: starting a process or planning a stack fails the test."""
    if os.environ.get(TIER_ENV) != "fast":
        return
    import multiprocessing.util
    import subprocess

    subprocess.Popen._execute_child = _refuse("process (subprocess)")  # type: ignore[attr-defined]
    multiprocessing.util.spawnv_passfds = _refuse("process (multiprocessing)")
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        setattr(os, name, _refuse(f"process (os.{name})"))
    import infra.plan.engine

    setattr(infra.plan.engine, "runpy",
            types.SimpleNamespace(run_path=_refuse("whole-stack plan (infra/plan/engine.py run_program)")))
