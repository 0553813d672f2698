"""Straggler detection with real ranks (torchrun, three CPU processes): every forward pass takes a
steady 20 ms more (tests/faults.py: a stand-in for a GPU's kernels, since a shared 2-core
machine's own timing is noise), one rank's 1.5x that. The slow rank is flagged within 100 steps
with its node, in the log and the run's records; a clean run of 1,000 steps flags no one."""

from __future__ import annotations

from pathlib import Path

import pytest

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


class Ranks:
    """Three ranks' window times as the collective would return them (this process is rank 1)."""

    rank, world, local_rank = 1, 3, 0

    def __init__(self, windows: list[list[float]]):
        self.windows = windows

    def all_gather_object(self, mine: object) -> list[object]:
        return [(c, 0.0, f"node{r}") for r, c in enumerate(self.windows.pop(0))]


@pytest.mark.parametrize("replace", ["false", "true"])
def test_a_persistent_straggler_asks_for_its_node_only_when_set(replace: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """STRAGGLER_REPLACE (off by default): rank 1 slow in three windows in a row writes the request
    its node's watchdog acts on; slow in two, then not, then slow again, it does not."""
    from training.trainer.progress import Progress

    monkeypatch.setenv("GTS_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("STRAGGLER_REPLACE", replace)
    slow, fine = [1.0, 1.5, 1.0], [1.0, 1.05, 1.0]
    progress = Progress(Ranks([slow, slow, fine, slow, slow]), None, None)  # type: ignore[arg-type]
    for step in range(50, 300, 50):
        progress.compare(step)
    assert not (tmp_path / "replace-request").exists()
    progress.comm = Ranks([slow])  # type: ignore[assignment]
    progress.compare(300)
    progress.close()
    assert (tmp_path / "replace-request").exists() == (replace == "true")


def test_a_process_exports_only_its_own_ranks_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of three: its gauge, not the other ranks' (another node exports those: two series per
    rank, one stale, otherwise)."""
    from training.trainer.progress import Progress

    set_for: list[str] = []

    class Gauge:
        def labels(self, **labels: str) -> Gauge:
            set_for.append(labels["rank"])
            return self

        def set(self, value: float) -> None:
            pass

    class Metrics:
        labels: dict[str, str] = {}
        straggler = Gauge()

    monkeypatch.delenv("GTS_PROGRESS_DIR", raising=False)
    Progress(Ranks([[1.0, 1.5, 1.0]]), None, Metrics()).compare(50)  # type: ignore[arg-type]
    assert set_for == ["1"]


def test_on_a_gpu_the_ranks_compare_the_gpus_own_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the host's clock sees only the kernels' launch (a slow GPU's time lands in the step's
    first synchronisation, on every rank alike): the compared compute is what CUDA events measured
    between the step's marks (forward, then optimizer), and the rest of the step is waiting."""
    import torch

    from training.trainer.progress import Progress

    clock = [0.0]

    class Event:  # torch.cuda.Event's timing calls, on a clock the test moves
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.t = -1.0

        def record(self) -> None:
            self.t = clock[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) * 1000

    gathered: list[tuple[float, float, str]] = []

    class Gpu:
        rank, world, local_rank = 1, 2, 0
        device = torch.device("cuda")  # a device name only: nothing runs on it

        def all_gather_object(self, mine: tuple[float, float, str]) -> list[object]:
            gathered.append(mine)
            return [(mine[0] * 1.5, 0.0, "node0"), mine]

    monkeypatch.delenv("GTS_PROGRESS_DIR", raising=False)
    monkeypatch.setenv("STRAGGLER_WINDOW_STEPS", "2")
    progress = Progress(Gpu(), None, None)  # type: ignore[arg-type]
    assert progress.gpu is not None
    progress.gpu.event = Event
    for step in (1, 2):  # on the GPU: forward 0.3 s, backward 1.0 s, optimizer 0.2 s; the host saw 0.02 s
        for gpu_seconds in (0.3, 1.0, 0.2, None):
            progress.mark(0.0)
            clock[0] += gpu_seconds or 0.0
        progress.stepped(step, 1.6, 0.02)
    (compute, waited, _), = gathered
    assert compute == pytest.approx(2 * (0.3 + 0.2))  # the GPU's forward + optimizer, not the host's 0.04 s
    assert waited == pytest.approx(2 * (1.6 - 0.02))
    assert progress.flagged == {0: 1, 1: 0}  # rank 0, 1.5x slower on its GPU, is flagged
    assert progress.gpu.marks == []  # read once a window, then forgotten
    assert Progress(Ranks([[1.0]]), None, None).gpu is None  # type: ignore[arg-type]  # no device: the host's clock
