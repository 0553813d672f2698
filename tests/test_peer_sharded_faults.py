"""The sharded peer copy's faults (issue 46 review): a DCP write that fails (torch raises its
CheckpointException, a BaseException) is logged and the run goes on, never a dead thread or a
crash at close; a /dev/shm without room for the shard sends the copy to the scratch; a copy that
could not be made is left out, not recorded."""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from training.ckpt.peer import shardset
from training.ckpt.peer import sharded as peer_sharded
from training.ckpt.peer.share import NodeCopy
from training.ckpt.peer.sharded import ShardedPeer


def _failed() -> Future[Any]:
    future: Future[Any] = Future()
    try:  # as DCP raises it: the rank's exception wrapped with its traceback
        raise OSError(28, "No space left on device")
    except OSError as exc:
        future.set_exception(CheckpointException("save", {0: _wrap_exception(exc)}))
    return future


def test_a_failed_dcp_write_is_logged_the_directory_removed_and_close_does_not_raise(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node_copy = NodeCopy(str(tmp_path))
    me: Any = SimpleNamespace(tier=SimpleNamespace(buddy=1), holders=[1], comm=SimpleNamespace(rank=0), error="", sent=[])
    with caplog.at_level(logging.WARNING, logger="gts.peer"):
        ShardedPeer._send(me, 4, node_copy, _failed())  # on the caller's thread: it must not raise
    assert "No space left on device" in me.error and me.sent == []
    assert any("peer copy of step 4 of rank 0 not sent" in r.getMessage() for r in caplog.records)
    assert not Path(node_copy.dir).exists()

    closed: list[str] = []
    me = SimpleNamespace(_pending=_failed(), _sender=None, _in_flight=None, group=None,
                         stager=SimpleNamespace(close=lambda: closed.append("stager")))
    ShardedPeer.close(me)
    assert closed == ["stager"]


def test_a_dev_shm_without_room_for_the_shard_sends_the_copy_to_the_scratch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm, scratch = tmp_path / "shm", tmp_path / "scratch"
    shm.mkdir()
    scratch.mkdir()
    real = shutil.disk_usage

    def usage(path: str) -> Any:
        free = 64 * 2**20 if Path(path) == shm else 100 * 2**30  # a container's default /dev/shm
        return real(path)._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    me: Any = SimpleNamespace(tier=SimpleNamespace(share_root=str(shm), share_fallback=str(scratch)),
                              comm=SimpleNamespace(rank=0))
    node_copy, why = ShardedPeer._prepare(me, {"step": 4}, {"torch": 1}, 200 * 2**20)
    assert node_copy is not None and why == "" and Path(node_copy.dir).parent == scratch
    assert list(shm.iterdir()) == []  # nothing started in /dev/shm
    node_copy.remove()

    node_copy, why = ShardedPeer._prepare(me, {"step": 4}, {"torch": 1}, 200 * 2**30)
    assert node_copy is None and f"{shm}: {64 * 2**20} bytes free" in why and str(scratch) in why


def test_the_local_bytes_of_a_state_count_tensors_only() -> None:
    import torch

    state = ({"w": torch.zeros(10, 10), "groups": [{"lr": 0.1}]}, {"m": (torch.zeros(5, dtype=torch.float16), 3)})
    assert shardset.local_bytes(state) == 400 + 10


def test_a_chosen_set_that_dcp_cannot_load_is_forgotten_so_the_restart_goes_to_the_durable_tiers(
        tmp_path: Path) -> None:
    """After the vote every rank loads the set; where DCP fails (a file the planner's prediction
    missed), the node's store forgets its copies before the error goes up, so that the restart
    does not choose the same set again and again."""
    forgotten: list[tuple[str, int, int]] = []
    peer: Any = object.__new__(ShardedPeer)
    peer.comm = SimpleNamespace(local_rank=0, node=1, barrier=lambda: None)
    peer.tier = SimpleNamespace(stores=["10.0.0.1:1", "10.0.0.2:1"],
                                link=SimpleNamespace(keep_only=lambda *a: forgotten.append(a)))
    peer.folder, peer._restored = tmp_path, None

    def fails(*args: Any) -> None:
        raise RuntimeError("__3_0.distcp: no such file")

    sharded: Any = SimpleNamespace(restore=fails, comm=SimpleNamespace(rank=0, world=2))
    with pytest.raises(RuntimeError, match="no such file"):
        peer_sharded.restore(sharded, peer, 4, None, None, 4)  # type: ignore[arg-type]
    assert forgotten == [("10.0.0.2:1", 0, 0)]  # its own node's store: every copy dropped
    assert peer.folder is None  # released as before


def test_a_holder_that_refuses_leaves_the_other_stores_their_copies(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """PEER_HOLDERS=2: the first holder answers 507 (full); the second and the node's own store
    still get every file, and the copy is reported as not sent (it is not held everywhere)."""
    from training.ckpt.manager import rng_name
    from training.ckpt.peer.client import PeerRefused

    node_copy = NodeCopy(str(tmp_path))
    for name in (shardset.file_name(1, "shard"), rng_name(1)):
        (Path(node_copy.dir) / name).write_bytes(b"x" * 10)
    got: list[tuple[str, str]] = []

    def put(store: str, world: int, rank: int, step: int, kind: str, *_: Any) -> None:
        if store == "full:1":
            raise PeerRefused(f"{store} refused: over its budget (507)")
        got.append((store, kind))
    done: Future[Any] = Future()
    done.set_result(None)
    tier = SimpleNamespace(stores=["own:0", "full:1", "next:2"], link=SimpleNamespace(put=put), generation="0-0")
    me: Any = SimpleNamespace(tier=tier, holders=[1, 2], comm=SimpleNamespace(rank=1, node=0, world=3), error="",
                              sent=[])
    with caplog.at_level(logging.WARNING, logger="gts.peer"):
        ShardedPeer._send(me, 4, node_copy, done)
    assert got == [("next:2", "shard"), ("own:0", "shard"), ("next:2", "rng"), ("own:0", "rng")]
    assert me.sent == [] and "shard to full:1" in me.error and "rng to full:1" in me.error
    assert not Path(node_copy.dir).exists()
