"""A bucket that does not answer at start is not an empty bucket: a node with an empty disk whose
listing (or a listed step's manifest) fails with a 503 must not start from step 0, upload over
the run's history and then prune it. It stops with a retryable code (run_control.EXIT_RETRY)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from training.ckpt.manager import CheckpointManager, step_dir
from training.distributed import Comm
from training.ckpt.run_control import EXIT_RETRY, HistoryUnknown, choose_checkpoint, say_storage
from tests.test_checkpoint_owners import _topo, _two_nodes_saved


class Unavailable(OSError):
    """What a store stand-in raises for a 503 (no permanent cause: a retry may help)."""


def _failing(monkeypatch: pytest.MonkeyPatch, fs: Any, method: str, when: Any) -> None:
    """`fs.method` raising a 503 for the paths `when` picks (undone after the test: fsspec
    shares file system instances between managers)."""
    real = getattr(fs, method)

    def call(path: str, *args: Any, **kwargs: Any) -> Any:
        if when(path):
            raise Unavailable("503 Service Unavailable")
        return real(path, *args, **kwargs)
    monkeypatch.setattr(fs, method, call)


@pytest.mark.parametrize("method,when", [
    ("ls", lambda path: path.rstrip("/").endswith("bucket")),   # the bucket's listing
    ("cat", lambda path: step_dir(20) in path),                  # the newest listed step's manifest
])
def test_an_unreadable_bucket_never_lets_an_empty_node_start_from_zero(tmp_path: Path, method: str, when: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url = _two_nodes_saved(tmp_path, (10, 20))
    fresh = CheckpointManager(str(tmp_path / "replacement"), url, _topo(1), keep=5)
    try:
        assert fresh.remote is not None
        if method == "cat":  # step 10 is readable: the run resumes from it, not from 0
            _failing(monkeypatch, fresh.remote.fs, method, when)
            found = choose_checkpoint(fresh, Comm("torchrun"))
            assert found is not None and found.step == 10
            when = lambda path: step_dir(10) in path or step_dir(20) in path  # noqa: E731
        _failing(monkeypatch, fresh.remote.fs, method, when)
        with pytest.raises(HistoryUnknown, match="503 Service Unavailable.*could write over"):
            choose_checkpoint(fresh, Comm("torchrun"))
    finally:
        fresh.close()
    assert sorted(p.name for p in (tmp_path / "bucket").iterdir() if p.name.startswith("step-")) == [
        step_dir(10), step_dir(20)]


def test_a_bucket_with_nothing_under_the_prefix_still_starts_from_zero(tmp_path: Path) -> None:
    fresh = CheckpointManager(str(tmp_path / "node"), f"file://{tmp_path / 'empty'}", _topo(0), keep=5)
    try:
        assert choose_checkpoint(fresh, Comm("torchrun")) is None
    finally:
        fresh.close()


def test_a_step_restored_from_peer_memory_is_not_counted_as_durable(tmp_path: Path) -> None:
    """checkpointEvery auto counts steps since the last durable save: a peer copy (step 30 here,
    never in the bucket) must leave that at the bucket's newest step, 20, or under churn the
    durable tier may never be written again."""
    url = _two_nodes_saved(tmp_path, (10, 20))
    fresh = CheckpointManager(str(tmp_path / "replacement"), url, _topo(1), keep=5)
    try:
        found = choose_checkpoint(fresh, Comm("torchrun"), extra={30},
                                  load=lambda step: ({"step": step}, None) if step == 30 else fresh.load(step))
        assert found is not None and (found.step, found.durable) == (30, 20)
        found = choose_checkpoint(fresh, Comm("torchrun"))
        assert found is not None and (found.step, found.durable) == (20, 20)
    finally:
        fresh.close()


def _blip(monkeypatch: pytest.MonkeyPatch, fresh: CheckpointManager, failures: int) -> list[str]:
    """Step 20's manifests answer 503 `failures` times once the bucket is listed (the load's reads)."""
    assert fresh.remote is not None
    fs, real_cat, real_steps = fresh.remote.fs, fresh.remote.fs.cat, fresh.remote_steps
    armed, failed = [False], list[str]()

    def cat(path: str, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and step_dir(20) in path and len(failed) < failures:
            failed.append(path)
            raise Unavailable("503 Service Unavailable")
        return real_cat(path, *args, **kwargs)

    def steps() -> list[int]:
        found = real_steps()
        armed[0] = True
        return found
    monkeypatch.setattr(fs, "cat", cat)
    monkeypatch.setattr(fresh, "remote_steps", steps)
    monkeypatch.setattr("training.ckpt.run_control.LOAD_WAIT_S", (0.0, 0.0))
    return failed


def test_a_storage_blip_while_loading_is_retried_not_taken_for_a_bad_step(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    url = _two_nodes_saved(tmp_path, (10, 20))
    fresh = CheckpointManager(str(tmp_path / "replacement"), url, _topo(1), keep=5)
    try:
        failed = _blip(monkeypatch, fresh, failures=2)
        found = choose_checkpoint(fresh, Comm("torchrun"))
        assert found is not None and found.step == 20 and len(failed) == 2
    finally:
        fresh.close()


def test_a_store_that_stays_down_exits_for_a_retry_never_falls_back_or_refuses(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    url = _two_nodes_saved(tmp_path, (10, 20))
    fresh = CheckpointManager(str(tmp_path / "replacement"), url, _topo(1), keep=5)
    try:
        _blip(monkeypatch, fresh, failures=1000)
        with pytest.raises(HistoryUnknown, match=r"step 20 could not be read after 4 tries: .*503") as raised:
            choose_checkpoint(fresh, Comm("torchrun"))
        assert say_storage(Comm("torchrun"), raised.value) == EXIT_RETRY
    finally:
        fresh.close()
