"""The collectives the library runs itself (training/distributed.py Comm) leave nothing of
theirs for gloo's worker threads to free. Such a thread frees a finished collective's tensors
through Python, so it first creates a Python thread state, without the GIL; a fork at that
instant — a DataLoader starting its workers right after the step's collective — gives the child
a lock that CPython before 3.11.10 takes before re-initialising it, and the child never starts
(CPython gh-112275; the hang CI met in tests/test_dataloader_resume.py). Comm keeps each
collective's work until later ones completed, so this thread frees the tensors, with the GIL.

Two gloo ranks under torchrun run the step's collectives (any_true, mean, all_gather_object)
with every tensor handed to torch.distributed watched by weakref.finalize: each is freed, and
on the main thread."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.training_helpers import BIN, ROOT

RANK_SCRIPT = r'''
import sys, threading, weakref
import torch, torch.distributed as dist
from training.distributed import Comm

freed = {"main": 0, "other": []}
watched = [0]

def watch(*tensors):
    for t in tensors:
        for x in (t if isinstance(t, list) else [t]):
            watched[0] += 1
            weakref.finalize(x, record)

def record():
    thread = threading.current_thread()
    if thread is threading.main_thread():
        freed["main"] += 1
    else:
        freed["other"].append(thread.name)

for name in ("all_reduce", "all_gather"):
    real = getattr(dist, name)
    def wrapped(*args, _real=real, **kwargs):
        watch(*[a for a in args if isinstance(a, (torch.Tensor, list))])
        return _real(*args, **kwargs)
    setattr(dist, name, wrapped)

comm = Comm("torchrun")
for step in range(150):
    assert comm.any_true(step % 7 == comm.rank, False) == [step % 7 in (0, 1), False]
    if step % 5 == 0:
        mine = torch.tensor(float(comm.rank))
        assert comm.mean(mine) == 0.5 and mine.item() == comm.rank  # the caller's tensor is left as it was
        assert comm.all_gather_object({"rank": comm.rank, "step": step}) == [{"rank": r, "step": step} for r in range(2)]
before_close = freed["main"]
comm.close()
import gc; gc.collect()
others = sorted(set(freed["other"]))
line = (f"rank {comm.rank} watched {watched[0]} freed on main {freed['main']} (before close {before_close}) "
        f"elsewhere {len(freed['other'])} {others}\n")
sys.stdout.write(line)  # one write: the two ranks share the pipe
sys.stdout.flush()
'''


def test_the_library_collectives_leave_gloo_threads_nothing_to_free(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = re.findall(r"rank (\d) watched (\d+) freed on main (\d+) \(before close (\d+)\) elsewhere (\d+) (.*)$",
                       done.stdout, re.M)
    assert sorted(rank for rank, *_ in lines) == ["0", "1"], done.stdout[-3000:]
    for rank, watched, on_main, before_close, elsewhere, names in lines:
        assert int(watched) >= 150 + 30 * 5, (rank, watched)  # every collective's tensors were watched
        assert int(elsewhere) == 0, f"rank {rank}: {elsewhere} tensors freed off the main thread, by {names}"
        assert int(on_main) == int(watched), f"rank {rank}: {on_main} of {watched} freed"


def test_a_forking_loader_on_an_affected_python_is_warned_with_the_fix() -> None:
    """training/loaders.py: a DataLoader whose workers start by fork, on a CPython with
    gh-112275, is named with the release that fixes it and the DataLoader option that avoids
    it; nothing is said where there is nothing to fix."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from training.loaders import fork_hang_warning

    data = TensorDataset(torch.arange(8))
    forked = DataLoader(data, num_workers=2, multiprocessing_context="fork")
    warning = fork_hang_warning(forked, (3, 11, 7))
    assert warning is not None and "3.11.7" in warning and "3.11.10" in warning and "gh-112275" in warning
    assert "multiprocessing_context='forkserver'" in warning
    assert fork_hang_warning(forked, (3, 10, 14)) is not None and fork_hang_warning(forked, (3, 9, 19)) is not None
    for fixed in [(3, 11, 10), (3, 10, 15), (3, 9, 20), (3, 12, 0), (3, 13, 1)]:
        assert fork_hang_warning(forked, fixed) is None, fixed
    assert fork_hang_warning(DataLoader(data, num_workers=0), (3, 11, 7)) is None  # no workers: no fork
    for method in ("forkserver", "spawn"):
        assert fork_hang_warning(DataLoader(data, num_workers=2, multiprocessing_context=method), (3, 11, 7)) is None


class FakeWork:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_work_is_let_go_once_enough_newer_ones_completed_and_it_is_old_enough(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Comm._done on a fake clock: a work is waited for and kept while fewer than HELD_WORKS
    newer ones completed or it is younger than HELD_S; then the oldest goes first."""
    import collections

    import training.distributed as distributed

    now = [100.0]
    monkeypatch.setattr(distributed, "_clock", lambda: now[0])
    comm = distributed.Comm.__new__(distributed.Comm)
    comm._held = collections.deque()
    works = [FakeWork() for _ in range(distributed.HELD_WORKS + 3)]
    for work in works:  # all at once: none is old enough to go
        comm._done(work)
    assert all(w.waited for w in works) and [w for _, w in comm._held] == works
    now[0] += distributed.HELD_S + 0.5  # all old enough now: the newest HELD_WORKS stay, this one included
    last = FakeWork()
    comm._done(last)
    assert [w for _, w in comm._held] == [*works[-(distributed.HELD_WORKS - 1):], last]
    newer = FakeWork()
    comm._done(newer)  # the oldest kept one goes; the new one, young, stays
    assert [w for _, w in comm._held] == [*works[-(distributed.HELD_WORKS - 2):], last, newer]
    now[0] += 0.1
    comm._done(FakeWork())  # one more than HELD_WORKS, and the oldest kept one is old: it goes
    assert len(comm._held) == distributed.HELD_WORKS


def test_the_warning_is_logged_once_a_process_where_a_process_group_exists(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """warn_fork_hang (the Checkpointer's loaders, the reference trainer's per-epoch loader): once
    per loader name, and only with a process group (whose threads trigger the hang)."""
    import logging

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import training.loaders as loaders

    monkeypatch.setattr(loaders, "_WARNED", set())
    monkeypatch.setattr(loaders, "fork_hang_warning", lambda loader, fix: fix)
    loader = DataLoader(TensorDataset(torch.arange(8)), num_workers=2)
    with caplog.at_level(logging.WARNING, logger="gts.loaders"):
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
        loaders.warn_fork_hang("trainer", loader)
        assert not caplog.records  # no group: nothing forks after a collective
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        for _ in range(3):  # an epoch each
            loaders.warn_fork_hang("trainer", loader)
        loaders.warn_fork_hang("other", loader, fix="its own fix")
    assert [r.getMessage() for r in caplog.records] == [f"loader 'trainer': {loaders.FORK_HANG_FIX}",
                                                         "loader 'other': its own fix"]
