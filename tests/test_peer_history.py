"""A store cut off from the run keeps copies of the history the run left (issue 46's known gap):
every store records the restores its world made, a restore merges the records of every store it
lists, and a copy a later restore left behind is never offered — on real store processes, for
replicated and sharded copies, with the generation ordered after every one the stores have seen
whatever rank 0's clock says."""

from __future__ import annotations

import io
import time
import types
from typing import Any

import pytest
import torch

from tests.peer_helpers import store_process
from tests.training_helpers import RDZV_TEST_KEY
from training.distributed import Comm
from training.ckpt.peer import history, shardset, wire
from training.ckpt.peer.client import Link
from training.ckpt.peer.tier import PeerTier

KEY = RDZV_TEST_KEY.encode()


def _put(link: Link, store: str, step: int, value: float, generation: str, kind: str = "full") -> None:
    buffer = io.BytesIO()
    torch.save({"state": {"w": torch.full((4,), value)}, "rng": {"r": torch.tensor([1])}, "step": step}, buffer)
    data = buffer.getvalue()
    link.put(store, 1, 0, step, kind, data, wire.payload_digest(data), generation)


def _tier(stores: list[str]) -> PeerTier:
    tier = PeerTier(Comm("torchrun"), 10, KEY, stores[0], "")
    tier.stores = stores
    return tier


def test_a_store_cut_off_before_a_restore_never_offers_the_history_the_run_left() -> None:
    """Nodes a, b, c hold steps 100 and 110 of the first history; c is cut off; a and b restore the
    disk's step 90 and reach step 100 again. When c is back, its steps 100 and 110 (replicated and
    sharded alike) are not offered: step 110 would have been the newest step, of a history that is
    no longer the run's."""
    with store_process() as a, store_process() as b, store_process() as c:
        link, first = Link(KEY), "1000-0"
        for store in (a, b, c):
            for step in (100, 110):
                _put(link, store, step, step / 100, first)
                for kind in ("shard", "meta", "train"):
                    _put(link, store, step, step / 100, first, kind)
        before = _tier([a, b, c])
        assert before.steps() == {100, 110} and {s for s, _, _ in shardset.sets(before._held())} == {100, 110}

        second = "1001-90"  # the world of a and b restored the disk's step 90 (each node tells its own store)
        for store in (a, b):
            link.keep_only(store, 0, 90, second, history.DURABLE)
        assert link.listing(c) and not link.listing(a)
        for store in (a, b):
            _put(link, store, 100, 2.0, second)

        back = _tier([a, b, c])  # c rejoins with what it held
        assert back.steps() == {100}
        assert shardset.sets(back._held()) == {}  # c's sharded sets are of the history left too
        assert {(store, e[6]) for store, e in back._held()} == {(a, second), (b, second)}
        loaded = back.load(100)
        assert loaded is not None and float(loaded[0]["w"][0]) == 2.0

        # The records are what keeps c's copies out: a world that listed a store without them would offer them.
        assert [[second, 90, history.DURABLE]] == link.held(a)[1] == link.held(b)[1] and link.held(c)[1] == []
        assert _tier([c]).steps() == {100, 110}


def test_a_peer_restore_records_the_copy_it_took_and_orders_after_every_generation_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore that takes one history's copy of step 100 keeps that copy usable (the world may
    fail again before its next copy) and leaves another history's step 100; the new generation
    orders after every one the stores listed even when rank 0's clock is far behind."""
    with store_process() as a, store_process() as c:
        link = Link(KEY)
        _put(link, c, 100, 1.0, "5000-0")  # an older history's step 100, on c alone
        link.keep_only(a, 0, 60, "7000-60", history.DURABLE)  # the run restored 60 (a's store recorded it) ...
        _put(link, a, 100, 2.0, "7000-60")  # ... and reached 100 again
        clock = types.SimpleNamespace(time=lambda: 10.0, perf_counter=time.perf_counter)  # rank 0's, far behind
        monkeypatch.setattr("training.ckpt.peer.tier.time", clock)
        tier = _tier([a, c])
        assert tier.steps() == {100}
        loaded = tier.load(100)
        assert loaded is not None and float(loaded[0]["w"][0]) == 2.0 and tier.restored_gen == "7000-60"
        tier.keep_only(100)
        assert tier.generation == "7001-100"  # after 7000, not the clock's 10
        assert link.held(a)[1] == [["7000-60", 60, history.DURABLE], ["7001-100", 100, "7000-60"]]
        again = _tier([a, c])  # the world fails again before its next copy: the copy it took still serves
        assert again.steps() == {100} and {e[6] for _, e in again._held()} == {"7000-60"}


def _rec(generation: str, step: int, chosen: str = history.DURABLE) -> list[Any]:
    return [generation, step, chosen]


@pytest.mark.parametrize("step,generation,records,left", [
    (110, "1-0", [_rec("2-90", 90)], True),  # a later restore went back before it
    (90, "1-0", [_rec("2-90", 90)], True),  # ... to its step, and took the disk's
    (90, "1-0", [_rec("2-90", 90, "1-0")], False),  # ... to its step, and took this very copy
    (80, "1-0", [_rec("2-90", 90)], False),  # before the restore's step: the same history
    (110, "3-90", [_rec("2-90", 90)], False),  # sent after that restore
    (110, "1-0", [_rec("2-50", 50), _rec("3-120", 120, "2-50")], True),  # left two restores ago
    (110, "junk", [_rec("2-50", 50)], True),  # a generation that is none orders before every one
])
def test_which_copies_a_restore_left_behind(step: int, generation: str, records: list[list[Any]], left: bool) -> None:
    assert history.left_behind(step, generation, records) is left


def test_a_generation_is_ordered_after_every_plausible_one_seen() -> None:
    assert history.next_generation(40, ["7-0", "12-30", "junk"], now=5.0) == "13-40"
    assert history.next_generation(40, [], now=1234.9) == "1234-40"
    # a store listing a generation years ahead (a clock set wrong, or worse) does not pin every later
    # restore to one number, which would order a restore by its step alone
    now = 1_800_000_000.0
    far = f"{int(now) + 10 * 365 * 86400}-100"
    assert history.next_generation(90, [far, "7-0"], now=now) == "1800000000-90"
    assert not history.plausible(far, now) and history.plausible(f"{int(now) + 60}-1", now)
    held: list[tuple[str, list[Any]]] = [("c", [1, 0, 110, "full", "d", 3, far]), ("a", [1, 0, 100, "full", "d", 3, "5-90"])]
    assert history.current(held, [[far, 0, history.DURABLE]], now) == [held[1]]  # neither its copy nor its record
    assert not history.valid_record(["1-0", True, "durable"]) and not history.valid_record(["1-0", 3, "x"])


def test_a_store_rank_0_could_not_list_still_counts_with_the_records_other_ranks_listed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 picks the copies every rank tries. Store a (the record of the restore to 90, and the
    run's step 100) is out of rank 0's reach for a moment; store c holds the history left. With the
    record another rank listed, c's step 100 is not restored: the disk or the bucket decides."""
    with store_process() as c:
        link = Link(KEY)
        _put(link, c, 100, 1.0, "1000-0")
        tier = _tier([c])  # rank 0's listing: store a did not answer
        gathered: list[Any] = []

        def all_gather_object(obj: Any) -> list[Any]:
            gathered.append(obj)
            return [obj, [["1001-90", 90, history.DURABLE]]] if len(gathered) == 1 else [obj]  # rank 1 listed a
        monkeypatch.setattr(tier.comm, "all_gather_object", all_gather_object)
        assert tier.load(100) is None
        assert gathered[0] == [] and gathered[1] == []  # rank 0's own records (none), then no candidate
