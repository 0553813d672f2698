"""Issue 46: a node's local rank 0 fetches the peers' newest full copy while its worker builds the
model (training/ckpt/peer/tier.py `prefetch`); a restore of that copy takes those bytes instead
of fetching again, any other restore fetches as before, a flipped byte is refused by name during
the prefetch as during a restore, and a copy no restore took is dropped. Real stores on loopback;
the GETs are counted by wrapping the real client."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from tests.peer_helpers import store_process
from tests.training_helpers import RDZV_TEST_KEY
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link
from training.ckpt.peer.tier import PeerTier
from training.distributed import Comm

KEY = RDZV_TEST_KEY.encode()


def _copy(step: int, value: float) -> bytes:
    buffer = io.BytesIO()
    torch.save({"state": {"w": torch.full((8,), value), "step": step}, "rng": {"r": torch.tensor([7])}, "step": step},
               buffer)
    return buffer.getvalue()


def _put(store: str, step: int, data: bytes | None = None, named: str = "") -> None:
    data = data if data is not None else _copy(step, float(step))
    Link(KEY).put(store, 1, 0, step, "full", data, named or wire.payload_digest(data))


def _counted(tier: PeerTier) -> list[tuple[str, int]]:
    """(store, step) of every full copy the tier GETs from here on."""
    fetched: list[tuple[str, int]] = []
    real: Callable[..., Any] = tier.link.get

    def get(store: str, world: int, rank: int, step: int, kind: str, gen: str) -> Any:
        if kind == "full":
            fetched.append((store, step))
        return real(store, world, rank, step, kind, gen)
    tier.link.get = get  # type: ignore[method-assign, assignment]
    return fetched


def _prefetched(tier: PeerTier) -> None:
    tier.prefetch()
    assert tier._prefetch is not None
    tier._prefetch.join()  # the model is built by now: the fetch has ended


def test_a_restore_of_the_prefetched_copy_fetches_it_once() -> None:
    with store_process() as store:
        _put(store, 40)
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        fetched = _counted(tier)
        _prefetched(tier)
        assert fetched == [(store, 40)]
        loaded = tier.load(40)
        assert loaded is not None and torch.equal(loaded[0]["w"], torch.full((8,), 40.0))
        assert fetched == [(store, 40)]  # the restore took the prefetched bytes
        assert tier._prefetched is None  # and holds them no longer


def test_a_restore_of_another_step_fetches_that_one_and_drops_the_prefetched_copy() -> None:
    with store_process() as store:
        _put(store, 40)
        _put(store, 50)
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        fetched = _counted(tier)
        _prefetched(tier)
        assert fetched == [(store, 50)]  # the newest
        loaded = tier.load(40)  # the ranks agreed on an older step (another rank lacked 50)
        assert loaded is not None and torch.equal(loaded[0]["w"], torch.full((8,), 40.0))
        assert fetched == [(store, 50), (store, 40)] and tier._prefetched is None


def test_a_flipped_byte_met_by_the_prefetch_is_refused_by_name_and_the_next_store_used() -> None:
    with store_process() as first, store_process() as second:
        good = _copy(40, 4.0)
        flipped = bytearray(good)
        flipped[-200] ^= 0xFF
        _put(first, 40, bytes(flipped), wire.payload_digest(good))  # the sender named the good bytes' digest
        _put(second, 40, good)
        tier = PeerTier(Comm("torchrun"), 10, KEY, first, "")
        tier.stores = [first, second]
        fetched = _counted(tier)
        _prefetched(tier)
        assert tier.refusals == [f"peer copy of step 40 of rank 0/1 (full) held by {first} does not match its digest: "
                                 "refused"]
        loaded = tier.load(40)
        assert loaded is not None and torch.equal(loaded[0]["w"], torch.full((8,), 4.0))
        assert fetched == [(first, 40), (second, 40)]  # each once, in the prefetch


def test_a_prefetched_copy_no_restore_took_is_dropped() -> None:
    with store_process() as store:
        _put(store, 40)
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        _prefetched(tier)
        assert tier._prefetched is not None and tier._prefetched[0] == 40
        tier.keep_only(60)  # a newer durable step was restored
        assert tier._prefetched is None and tier._prefetch is None


def test_no_copy_no_prefetch() -> None:
    with store_process() as store:
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        fetched = _counted(tier)
        _prefetched(tier)
        assert fetched == [] and tier._prefetched is None


def test_a_copy_every_holder_refused_to_the_prefetch_is_not_asked_for_again() -> None:
    with store_process() as store:
        good = _copy(40, 4.0)
        flipped = bytearray(good)
        flipped[-200] ^= 0xFF
        _put(store, 40, bytes(flipped), wire.payload_digest(good))
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        fetched = _counted(tier)
        _prefetched(tier)
        assert tier.load(40) is None  # the durable tiers then
        assert fetched == [(store, 40)] and len(tier.refusals) == 1
