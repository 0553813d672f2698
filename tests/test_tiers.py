"""The fast tier (`make test-fast`, tests/tiers.py): its selection is not empty, it leaves out the
tests that start processes, plan whole stacks or boot, and under it a test that starts a process
anyway fails naming why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    assert not any("test_the_plan_group_scales_the_stack_and_rotates_every_run" in n for n in fast)  # SLOW's


@pytest.mark.parametrize("start", ["import subprocess; subprocess.run(['true'])",
                                   "import os; os.system('true')",
                                   "import multiprocessing as m; p = m.get_context('spawn').Process(target=print); p.start()"])
def test_under_the_fast_tier_a_process_fails_the_test(start: str) -> None:
    code = f"from tests import tiers; tiers.guard()\n{start}"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, tiers.TIER_ENV: "fast", "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and "FastTierError: the fast tier (make test-fast) runs no process" in run.stderr, \
        run.stderr[-2000:]


def test_under_the_fast_tier_a_whole_stack_plan_fails_the_test() -> None:
    # imported first, as pytest's collection does (croniter asks `file` for the architecture at import)
    code = "from tests import tiers\nfrom tests.harness import run_stack\ntiers.guard()\nrun_stack('dev')"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, tiers.TIER_ENV: "fast", "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and "runs no whole-stack plan" in run.stderr, run.stderr[-2000:]
