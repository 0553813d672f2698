"""The two test tiers: `make test` runs every test; `make test-fast` runs the ones marked neither
`slow` nor `boot`: tests that start no process, plan no whole stack under Pulumi's mocks and boot
no node.

A test is marked `slow` by rule (tests/conftest.py calls `mark`), not by hand: when it or a
fixture it uses names, in its code or in the code of the tests/ helpers it calls (followed all
the way), a process or a whole-stack plan: the subprocess and multiprocessing modules, os.fork
and its kin, the mock engine's `run_program` or the plan's `build_plan`. What the rule cannot
see (project code a test calls that starts a process itself) is listed in SLOW. The rule errs
towards slow: a test that names such a helper without calling it is slow too. Under
`make test-fast` (GTS_TEST_TIER=fast) `guarded` (around each test) refuses starting a process or
planning a stack, records each refusal and fails the test at its teardown, naming what was started
and from where (even from a thread or under `except Exception`), so a test the rule misses is found.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import sysconfig
import traceback
import types
from collections.abc import Iterator
from typing import Any

import pytest

TIER_ENV = "GTS_TEST_TIER"
SLOW_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing", "pty", "asyncio.subprocess"})
SLOW_CALLABLES = frozenset({("infra.plan.engine", "run_program"), ("infra.plan.__main__", "build_plan"),
                            ("infra.plan.__main__", "main"), ("posix", "fork"), ("posix", "system"),
                            ("posix", "posix_spawn"), ("posix", "posix_spawnp"), ("posix", "forkpty"), ("os", "popen"),
                            ("asyncio.subprocess", "create_subprocess_exec"),
                            ("asyncio.subprocess", "create_subprocess_shell")})
# Tests the rule cannot see as slow: they call project code that starts processes or plans
# stacks itself (file name -> test function names; every test of the file when empty).
SLOW: dict[str, frozenset[str]] = {
    "test_plan_bench.py": frozenset({"test_the_plan_group_scales_the_stack_and_balances_every_run"}),  # infra/plan/bench.py
    "test_bench.py": frozenset({"test_a_resume_figure_stops_at_its_line_not_at_the_exit",  # bench_resume._timed
                                "test_a_resume_method_that_never_exits_is_killed_and_has_no_figure"}),
}


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _slow_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in SLOW_MODULES)


def _is_slow_object(obj: Any) -> bool:
    """A slow module, anything defined in one (`from subprocess import run`, `from multiprocessing
    import Process`, whatever it is renamed to) or a slow callable of another module (os.popen)."""
    if isinstance(obj, types.ModuleType):
        return _slow_module(obj.__name__)
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and _slow_module(module):
        return True
    return (module, getattr(obj, "__name__", None)) in SLOW_CALLABLES


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
    if any(_slow_module(n) for n in names):  # `import subprocess` inside the function
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


_STDLIB = sysconfig.get_paths()["stdlib"]


def _where() -> str:
    """Where the refused call came from: the innermost frame outside the standard library and this
    file, and the module being imported when an import made it (a library's import-time call)."""
    stack = traceback.extract_stack()[:-2]  # less this function and `refused`
    importing = next((f.filename for f in reversed(stack) if "importlib._bootstrap" in f.filename), None)
    site = next((f for f in reversed(stack) if f.filename != __file__ and not f.filename.startswith(_STDLIB)),
                stack[-1] if stack else None)
    where = f"{site.filename}:{site.lineno} ({site.name})" if site else "an unknown place"
    return where + (" while a module was being imported" if importing else "")


class Refusals:
    """What a fast test tried to start: each refusal is recorded (the test fails at its teardown
    even when the error was raised in a thread or swallowed) and raised where it was made."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def refuse(self, what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            message = f"the fast tier (make test-fast) runs no {what}: called from {_where()}"
            self.made.append(message)
            raise FastTierError(message)
        return refused

    def failure(self) -> str | None:
        if not self.made:
            return None
        return ("the fast tier refused what ran during this test (if the test's own code did it, mark the test "
                "slow: SLOW in tests/tiers.py, or make the rule see it):\n" + "\n".join(self.made))


def prepare() -> None:
    """What the guard needs, loaded before it patches: infra.plan.engine imports croniter, which
    runs `file` at import (platform.architecture(), not cached: a library calling it inside a test
    is refused, the message naming the library's line and the import)."""
    for name in ("subprocess", "multiprocessing.util", "infra.plan.engine"):
        importlib.import_module(name)


@contextlib.contextmanager
def guarded() -> Iterator[Refusals]:
    """Under GTS_TEST_TIER=fast: starting a process or planning a stack is refused, recorded, and
    the patches undone after (tests/conftest.py wraps each test in it)."""
    refusals = Refusals()
    if os.environ.get(TIER_ENV) != "fast":
        yield refusals
        return
    prepare()
    import multiprocessing.util
    import subprocess

    import infra.plan.engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refusals.refuse("process (subprocess)"))
        patch.setattr(multiprocessing.util, "spawnv_passfds", refusals.refuse("process (multiprocessing)"))
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            patch.setattr(os, name, refusals.refuse(f"process (os.{name})"))
        patch.setattr(infra.plan.engine, "runpy", types.SimpleNamespace(
            run_path=refusals.refuse("whole-stack plan (infra/plan/engine.py run_program)")))
        yield refusals
