"""A peer restore fetches the chosen full copy once per node, not once per rank (issue 46): 2 nodes
x 2 local ranks as real processes (gloo), two stores as processes that log each full copy they
send. Local rank 0 fetches (its own node's store first), checks the digest and shares the copy
through a private file its node's ranks read; each rank's own small state is still its own; a
flipped byte is refused by name and the next copy used, still one fetch per node per tried copy;
the shared file is gone after the restore. The file itself: private, never through a link, and a
local rank that finds it not matching its digest refuses it by name."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from tests.peer_helpers import SENT_FULL, logged_store, payload, put, restore
from training.ckpt.peer import share, wire

STEP, WORLD = 50, 4


def _sent(log: Path) -> int:
    return sum(SENT_FULL in line for line in log.read_text().splitlines())


def _hold(first: str, second: str, flipped: bool = False) -> None:
    """Copies of a 2 x 2 world at STEP, each node's on the other node's store (its buddy): node 1's
    full copy (rank 2, w=6) on `first`, node 0's (rank 0, w=5) on `second`; each rank's own state
    (rng 100 + rank) on its buddy too. `flipped`: node 1's full copy has a byte flipped in transit."""
    for rank, store in ((0, second), (1, second), (2, first), (3, first)):
        put(store, WORLD, rank, STEP, "rank", payload(STEP, None, 100 + rank))
    good = payload(STEP, {"w": torch.full((4,), 6.0)}, 102)
    bad = bytearray(good)
    bad[-200] ^= 0xFF
    put(first, WORLD, 2, STEP, "full", bytes(bad) if flipped else good, wire.payload_digest(good))
    put(second, WORLD, 0, STEP, "full", payload(STEP, {"w": torch.full((4,), 5.0)}, 100))


def test_each_node_fetches_the_full_copy_once_and_every_rank_restores_it(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    with logged_store(tmp_path / "a.log") as first, logged_store(tmp_path / "b.log") as second:
        _hold(first, second)
        results = restore([first, second], shm, STEP)
    assert [r["w"] for r in results] == [[6.0] * 4] * WORLD  # one copy, the first listed, on every rank
    assert [r["rng"] for r in results] == [100, 101, 102, 103]  # each rank's own streams
    assert (_sent(tmp_path / "a.log"), _sent(tmp_path / "b.log")) == (2, 0)  # once per node, not per rank
    assert list(shm.iterdir()) == []  # the shared file is gone
    assert [r["dir_at_load"] for r in results] == [[False]] * WORLD  # removed before any rank read it


def test_a_flipped_byte_is_refused_by_name_and_the_next_copy_fetched_once_per_node(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    with logged_store(tmp_path / "a.log") as first, logged_store(tmp_path / "b.log") as second:
        _hold(first, second, flipped=True)
        results = restore([first, second], shm, STEP)
    assert [r["w"] for r in results] == [[5.0] * 4] * WORLD  # the next copy, on every rank
    assert [r["rng"] for r in results] == [100, 101, 102, 103]
    refused = f"peer copy of step {STEP} of rank 2/{WORLD} (full) held by {first} does not match its digest: refused"
    assert [r["refusals"] for r in results] == [[refused], [], [refused], []]  # by each node's fetching rank
    assert (_sent(tmp_path / "a.log"), _sent(tmp_path / "b.log")) == (2, 2)  # once per node per tried copy
    assert list(shm.iterdir()) == []


def test_the_shared_file_is_private_read_only_as_written_and_removed(tmp_path: Path) -> None:
    data = payload(STEP, {"w": torch.ones(2)}, 7)
    node_copy, path = share.publish(data, [str(tmp_path)], time.time())
    what = f"peer copy of step {STEP}"
    assert stat.S_IMODE(os.stat(node_copy.dir).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded, why = share.read(path, wire.payload_digest(data), what)
    assert why == "" and loaded is not None and int(loaded["rng"]["r"]) == 7
    with pytest.raises(FileExistsError):
        node_copy.write(data)  # O_EXCL: never written through a file already there
    os.chmod(path, 0o644)
    assert share.read(path, wire.payload_digest(data), what) == (
        None, f"{what} shared on this node at {path} is not a private file of this user (0600): refused")
    node_copy.remove()
    assert not os.path.exists(node_copy.dir)


def test_a_local_rank_refuses_a_shared_file_that_does_not_match_or_is_a_link(tmp_path: Path) -> None:
    data = payload(STEP, {"w": torch.ones(2)}, 7)
    node_copy, path = share.publish(data, [str(tmp_path)], time.time())
    what = f"peer copy of step {STEP} of rank 0/{WORLD} (full)"
    with open(path, "r+b") as fh:  # a byte changed after local rank 0 checked it
        fh.seek(-200, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-200, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert share.read(path, wire.payload_digest(data), what) == (
        None, f"{what} shared on this node at {path} does not match its digest: refused")
    planted = os.path.join(node_copy.dir, "planted.pt")
    os.symlink(path, planted)
    loaded, why = share.read(planted, wire.payload_digest(data), what)
    assert loaded is None and why.startswith(f"{what} shared on this node at {planted} cannot be opened")
    node_copy.remove()


def test_a_node_fetches_from_its_own_store_first_else_from_a_holder_that_depends_on_the_node() -> None:
    from tests.peer_helpers import KEY
    from training.distributed import Comm
    from training.ckpt.peer.tier import PeerTier

    tier = PeerTier(Comm("torchrun"), 10, KEY, "s0:1", "")
    tier.stores = ["s0:1", "s1:1", "s2:1", "s3:1"]

    def order(node: int, holders: list[str]) -> list[str]:
        tier.comm.node = node
        return tier._order(holders)
    holders = ["s1:1", "s2:1", "s3:1"]
    assert order(1, holders)[0] == "s1:1" and order(3, holders)[0] == "s3:1"  # its own store first
    assert order(1, holders) == ["s1:1", "s3:1", "s2:1"]  # then the others, from one that depends on the node
    assert order(2, holders) == ["s2:1", "s1:1", "s3:1"]
    assert order(0, ["s1:1", "s2:1"]) == ["s1:1", "s2:1"] and order(3, ["s1:1", "s2:1"]) == ["s2:1", "s1:1"]
