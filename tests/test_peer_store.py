"""The peer tier's store and its client, as real processes on loopback (issue 46): a store binds
the node's address, never the wildcard; every request needs the run's key; it keeps the newest
two steps per source; a copy whose bytes do not match the digest its sender named is refused by
name and the next copy is used; a world that restores a step makes the stores forget later ones."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import torch

from tests.peer_helpers import store_process
from tests.training_helpers import RDZV_TEST_KEY, ROOT, free_port
from training.distributed import Comm
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link, PeerRefused
from training.ckpt.peer.ring import buddy
from training.ckpt.peer.tier import PeerTier

KEY = RDZV_TEST_KEY.encode()


def _store(**env: str) -> contextlib.AbstractContextManager[str]:
    return store_process(**env)


def _copy(step: int, value: float) -> bytes:
    buffer = io.BytesIO()
    torch.save({"state": {"w": torch.full((8,), value), "step": step}, "rng": {"r": torch.tensor([7])}, "step": step},
               buffer)
    return buffer.getvalue()


def test_a_store_never_binds_the_wildcard() -> None:
    proc = subprocess.run([sys.executable, "-m", "training.ckpt.peer.store", "--addr", "0.0.0.0", "--port", str(free_port())],
                          cwd=ROOT, env={**os.environ, "RDZV_KEY": RDZV_TEST_KEY, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "peer store: --addr '0.0.0.0': the node's private address, never the wildcard"], proc.stderr


def test_a_request_without_the_run_s_key_is_refused_and_two_steps_are_kept() -> None:
    with _store() as store:
        stranger = Link(b"another-run-key-" + b"1" * 32)
        try:
            stranger.listing(store)
            raise AssertionError("a store answered a request signed with another key")
        except PeerRefused as exc:
            assert "not signed with this run's key" in str(exc)
        link = Link(KEY)
        for step in (10, 20, 30):
            data = _copy(step, float(step))
            link.put(store, 2, 1, step, "full", data, wire.payload_digest(data))
        assert [entry[2] for entry in link.listing(store)] == [20, 30]


def test_a_flipped_byte_is_refused_by_name_and_the_next_copy_used() -> None:
    with _store() as first, _store() as second:
        link = Link(KEY)
        good = _copy(40, 4.0)
        named = wire.payload_digest(good)
        flipped = bytearray(good)
        flipped[-200] ^= 0xFF
        link.put(first, 1, 0, 40, "full", bytes(flipped), named)  # the sender named the good bytes' digest
        tier = PeerTier(Comm("torchrun"), 10, KEY, first, "")
        assert tier.steps() == {40} and tier.load(40) is None
        assert tier.refusals == [f"peer copy of step 40 of rank 0/1 (full) held by {first} does not match its digest: "
                                 "refused"]
        link.put(second, 1, 0, 40, "full", good, named)
        tier.stores = [first, second]
        loaded = tier.load(40)
        assert loaded is not None and torch.equal(loaded[0]["w"], torch.full((8,), 4.0))
        assert loaded[1] is not None and int(loaded[1]["r"]) == 7
        link.put(first, 1, 0, 50, "full", _copy(50, 5.0), wire.payload_digest(_copy(50, 5.0)))
        assert tier.steps() == {40, 50}
        tier.keep_only(40)  # this world restored step 40: step 50 is another history now (each node tells its own store)
        assert tier.steps() == {40}


def test_the_buddy_ring_prefers_another_zone_and_never_the_node_itself() -> None:
    assert [buddy(n, ["a", "a", "a"]) for n in range(3)] == [1, 2, 0]
    assert [buddy(n, ["a", "a", "b", "b"]) for n in range(4)] == [2, 3, 0, 1]  # each node holds one node's copies
    assert [buddy(n, ["a", "b", "a", "b"]) for n in range(4)] == [1, 0, 3, 2]
    assert [buddy(n, list("aabbcc")) for n in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [buddy(n, ["a", "b"]) for n in range(2)] == [1, 0]


def test_two_nodes_lost_at_once_the_newest_step_still_held_else_the_disk(tmp_path: object) -> None:
    """Four nodes, each one's copies on the next (the ring); nodes 1 and 2 lost at once (2 holds
    1's copies): the newest step a surviving store still holds whole is restored; with every store
    gone, the disk's step. Never a step newer than one every rank can get, never another's state."""
    from pathlib import Path

    from training.ckpt.manager import CheckpointManager, Topology
    from training.ckpt.peer.tier import choose

    assert isinstance(tmp_path, Path)
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(_store()) for _ in range(4)]
        link = Link(KEY)
        for node in range(4):
            for step in (40, 50) + ((55,) if node == 1 else ()):  # node 1's step 55 reached store 2 alone
                data = _copy(step, float(step))
                link.put(procs[buddy(node, ["a"] * 4)], 4, node, step, "full", data, wire.payload_digest(data))
        manager = CheckpointManager(str(tmp_path / "disk"), None, Topology(0, 0, 1, 0, 1, 1), keep=5)
        manager.save(30, {"w": torch.full((8,), 3.0), "step": 30}, {"r": torch.tensor([7])}, lambda: None)
        manager.wait_commit()
        tier = PeerTier(Comm("torchrun"), 10, KEY, procs[0], "")
        tier.stores = [procs[0], procs[3]]  # the survivors' stores
        found = choose(manager, Comm("torchrun"), tier)
        assert found is not None and found.step == 50 and float(found.state["w"][0]) == 50.0
        tier.stores = ["127.0.0.1:1"]  # every store gone: nothing answers
        found = choose(manager, Comm("torchrun"), tier)
        assert found is not None and found.step == 30 and float(found.state["w"][0]) == 3.0
        manager.close()
