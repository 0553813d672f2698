"""Straggler detection with real ranks (torchrun, three CPU processes): every forward pass takes a
steady 20 ms more (tests/faults.py: a stand-in for a GPU's kernels, since a shared 2-core
machine's own timing is noise), one rank's 1.5x that. The slow rank is flagged within 100 steps
with its node, in the log and the run's records; a clean run of 1,000 steps flags no one."""

from __future__ import annotations

from pathlib import Path

from training import records
from tests.training_helpers import launch

COMPUTE = {"GTS_TEST_COMPUTE_MS": "20", "STRAGGLER_WINDOW_STEPS": "50", "GTS_NODE_NAME": "box"}


def test_a_rank_slowed_1_5x_is_flagged_within_100_steps(tmp_path: Path) -> None:
    run = launch(["--workload", "tiny", "--steps", "100", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--checkpoint-every", "100"], tmp_path,
                 {**COMPUTE, "GTS_TEST_SLOW_RANK": "1", "GTS_TEST_SLOW_FACTOR": "1.5"}, nproc=3)
    assert run.finish() == 0, run.output[-3000:]
    flagged = [line for line in run.lines if "straggler: rank" in line]
    assert flagged and all("straggler: rank 1 on node box" in line for line in flagged), flagged
    found = [e for e in records.read(str(tmp_path / "ck")) if e.kind == "straggler"]
    assert found and {e.rank for e in found} == {1} and all(e.step is not None and e.step <= 100 for e in found)


def test_a_clean_run_of_1000_steps_flags_no_one(tmp_path: Path) -> None:
    run = launch(["--workload", "tiny", "--steps", "1000", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--checkpoint-every", "1000", "--log-every", "100"], tmp_path, COMPUTE, nproc=3)
    assert run.finish(timeout=600) == 0, run.output[-3000:]
    assert run.final()[0] == 1000
    assert not [line for line in run.lines if "straggler" in line]
    assert not [e for e in records.read(str(tmp_path / "ck")) if e.kind == "straggler"]
