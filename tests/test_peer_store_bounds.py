"""The peer store's memory is bounded (issue 46's review): a byte budget (PEER_STORE_GIB) that
refuses a copy over it with a clear status; a world that restores a step leaves the stores
holding that step alone, of the world size that saved it (no empty source left behind, so the
eviction of sources still works)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_peer_store import KEY, _copy, _store
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link, PeerRefused
from training.ckpt.peer.store import Copies


def test_a_copy_over_the_store_s_budget_is_refused_with_507_and_the_held_ones_kept() -> None:
    with _store(PEER_STORE_GIB="1") as store:
        link = Link(KEY)
        small = _copy(10, 1.0)
        link.put(store, 2, 0, 10, "full", small, wire.payload_digest(small))
        big = bytes((1 << 30) + 1)
        with pytest.raises(PeerRefused, match=r"refused step 20 of rank 1: 507 .*budget of 1073741824 bytes "
                                              r"\(PEER_STORE_GIB\)"):
            link.put(store, 2, 1, 20, "rank", big, wire.payload_digest(big))
        assert [entry[:3] for entry in link.listing(store)] == [[2, 0, 10]]


def test_a_restore_leaves_only_the_restored_step_of_its_world_and_no_empty_source() -> None:
    copies = Copies(budget=1000)
    for world, rank, step in ((4, 0, 30), (4, 0, 40), (4, 1, 40), (4, 1, 50), (3, 0, 40), (2, 0, 60)):
        assert copies.put(world, rank, step, "full", "d", b"x" * 10)
    assert copies.keep_only(40, 4) == 4
    assert [entry[:3] for entry in copies.listing()] == [[4, 0, 40], [4, 1, 40]]
    assert copies.keep_only(0) == 2 and copies.listing() == []
    assert copies.put(5, 0, 70, "full", "d", b"x" * 10)  # eviction runs over no empty source
    assert not copies.put(5, 1, 70, "full", "d", b"x" * 991) and copies.size == 10


def test_the_default_budget_is_half_of_a_containers_memory_limit_where_that_is_less(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Job's pod has a memory limit below its node's memory: half the node's would pass it. The
    limit is its own cgroup's, found as /proc/self/cgroup names it (training/cgroup.py, which the
    checkpoint fetch's memory_room reads too)."""
    from training import cgroup
    from training.ckpt.peer.store import default_budget, memory

    node = memory(str(tmp_path / "absent"))
    v2, v1 = tmp_path / "v2" / "kubepods" / "pod1", tmp_path / "v1" / "docker" / "c1"
    v2.mkdir(parents=True)
    v1.mkdir(parents=True)
    monkeypatch.setattr(cgroup, "CONTROLLERS", (("", str(tmp_path / "v2"), "memory.max", "memory.current"), (
        "memory", str(tmp_path / "v1"), "memory.limit_in_bytes", "memory.usage_in_bytes")))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    (v2 / "memory.max").write_text(f"{8 << 30}\n")
    assert default_budget({}, str(proc)) == 4 << 30
    (v2 / "memory.max").write_text("max\n")  # no limit (cgroup v2)
    (v1 / "memory.limit_in_bytes").write_text(f"{node * 4}\n")  # no limit (cgroup v1: a number past the node's memory)
    proc.write_text("0::/kubepods/pod1\n4:memory:/docker/c1\n")
    assert default_budget({}, str(proc)) == node // 2
    assert default_budget({"PEER_STORE_GIB": "3"}, str(proc)) == 3 << 30  # the setting wins
