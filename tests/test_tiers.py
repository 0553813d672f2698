"""The fast tier (`make test-fast`, tests/tiers.py): its selection is not empty, it leaves out the
tests that start processes, plan whole stacks or boot, and under it a test that starts a process
anyway fails naming why."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


from tests import conftest, test_cost, test_training, tiers
from tests.harness import ROOT


def test_the_rule_follows_helpers_and_fixtures_to_a_process() -> None:
    # The functions are looked up by name (a string): the rule, following this test's own code,
    # would otherwise see them and put this test, which starts nothing, in the slow tier.
    sigterm = getattr(test_training, "test_sigterm_then_restart_is_bit_identical")
    assert tiers.slow_code(sigterm)  # launch() (tests/training_helpers.py) starts torchrun
    for fixture in ("moto", "reference"):  # MotoServer and launch(), imported inside the fixtures
        assert any(tiers.slow_code(f) for f in tiers._functions(getattr(conftest, fixture))), fixture
    # cost arithmetic on a parsed spec starts nothing
    assert not tiers.slow_code(getattr(test_cost, "test_on_demand_always_on"))


def _fast_selection() -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                          "-m", "not slow and not boot", "tests"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_the_fast_selection_is_not_empty_and_starts_no_process() -> None:
    fast = _fast_selection()
    assert len(fast) > 100, fast
    assert "tests/test_check_phase.py::test_k8s_and_teams_do_not_import_each_other" in fast
    process = "tests/test_training.py::test_sigterm_then_restart_is_bit_identical"
    assert process not in fast and not any(n.startswith("tests/test_boot_") for n in fast)
    assert not any("test_the_plan_group_scales_the_stack_and_balances_every_run" in n for n in fast)  # SLOW's


def test_every_name_in_slow_is_a_test_of_its_file() -> None:
    """A renamed test would leave SLOW naming nothing, and the test in the fast tier."""
    for file, names in tiers.SLOW.items():
        module = importlib.import_module(f"tests.{file.removesuffix('.py')}")
        assert all(callable(getattr(module, name, None)) for name in names), (file, names)


# Each way a fast test can start a process; the guard fails each at its teardown, even when the
# refusal is raised in a thread or caught. The last imports a library that runs `file` at import.
GUARDED_TESTS = """
import multiprocessing, os, subprocess, sys, threading

def test_run():
    subprocess.run(["true"])

def test_system():
    os.system("true")

def test_spawn():
    multiprocessing.get_context("spawn").Process(target=print).start()

def test_in_a_thread():
    t = threading.Thread(target=subprocess.run, args=(["true"],))
    t.start()
    t.join()

def test_caught():
    try:
        os.popen("true")
    except Exception:
        pass

def test_a_library_at_import(tmp_path):
    (tmp_path / "arch_lib.py").write_text("import platform\\nBITS = platform.architecture()\\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import arch_lib
    except AssertionError:
        pass

def test_clean():
    assert os.getcwd()
"""


def test_under_the_fast_tier_a_process_fails_the_test(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import fast_tier_guard\n", encoding="utf-8")
    (tmp_path / "test_guarded.py").write_text(GUARDED_TESTS, encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_guarded.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, tiers.TIER_ENV: "fast", "PYTHONPATH": str(ROOT)})
    out = run.stdout + run.stderr
    errors = {line.split("::")[1].split()[0] for line in out.splitlines() if line.startswith("ERROR test_guarded.py::")}
    assert errors == {"test_run", "test_system", "test_spawn", "test_in_a_thread", "test_caught",
                      "test_a_library_at_import"}, out[-4000:]
    assert "PASSED test_guarded.py::test_clean" in out and "the fast tier refused what ran during this test" in out
    assert "runs no process (multiprocessing)" in out and "runs no process (os.system)" in out, out[-4000:]
    assert "arch_lib.py:2 (<module>) while a module was being imported" in out, out[-4000:]


def test_a_fast_test_file_passes_under_the_fast_tier() -> None:
    """The guard loads what it needs before it patches (croniter runs `file` at import)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "-m", "not slow and not boot", "tests/test_catalog.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, tiers.TIER_ENV: "fast"})
    assert run.returncode == 0 and " passed" in run.stdout and "error" not in run.stdout, run.stdout[-3000:]


def test_under_the_fast_tier_a_whole_stack_plan_fails_the_test() -> None:
    code = ("from tests import tiers\nfrom tests.harness import run_stack\n"
            "with tiers.guarded():\n    run_stack('dev')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, tiers.TIER_ENV: "fast", "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and "runs no whole-stack plan" in run.stderr, run.stderr[-2000:]


RULE_SUBJECTS = """
import os
from subprocess import run
from subprocess import Popen as P
from multiprocessing import Process

def by_name(): run(["true"])
def renamed(): P(["true"])
def popen(): os.popen("true")
def process(): Process(target=print).start()
def clean(): return os.getcwd()
"""


def test_the_rule_sees_imported_and_renamed_process_starters() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(RULE_SUBJECTS, "rule_subjects.py", "exec"), namespace)  # noqa: S102 - the subjects' own text
    slow = {name for name in ("by_name", "renamed", "popen", "process", "clean") if tiers.slow_code(namespace[name])}
    assert slow == {"by_name", "renamed", "popen", "process"}
