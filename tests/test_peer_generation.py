"""Ranks restore one copy, not merely one step (issue 46's review): copies carry the history they
belong to (a generation: when rank 0 restored, and the step it restored), rank 0
lists the copies every rank tries in order, and a copy that any rank could not get is dropped
by every rank together (an all-reduce), so no two ranks ever mix copies or tiers."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tests.test_peer_store import KEY, _store
from training.distributed import Comm
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link
from training.ckpt.peer.tier import PeerTier


def _copy(step: int, value: float, rng: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"state": {"w": torch.full((4,), value)}, "rng": {"r": torch.tensor([rng])}, "step": step}, buffer)
    return buffer.getvalue()


def _put(link: Link, store: str, step: int, value: float, rng: int, generation: str, kind: str = "full") -> None:
    data = _copy(step, value, rng)
    link.put(store, 1, 0, step, kind, data, wire.payload_digest(data), generation)


def test_two_histories_at_one_step_the_newest_generation_is_restored_whole() -> None:
    with _store() as first, _store() as second:
        link = Link(KEY)
        _put(link, first, 50, 5.0, 1, "0-40")   # the first history's step 50
        _put(link, second, 50, 6.0, 2, "1-45")  # after a restart from 45, the world reached 50 again
        tier = PeerTier(Comm("torchrun"), 10, KEY, first, "")
        tier.stores = [first, second]
        loaded = tier.load(50)
        assert loaded is not None and float(loaded[0]["w"][0]) == 6.0
        assert loaded[1] is not None and int(loaded[1]["r"]) == 2  # its own state of the same history


def test_a_copy_one_rank_could_not_get_is_dropped_by_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    with _store() as store:
        _put(Link(KEY), store, 50, 5.0, 1, "0-40")
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        votes: list[tuple[bool, ...]] = []

        def any_true(*flags: bool) -> list[bool]:
            votes.append(flags)
            return [True]  # another rank missed the copy
        monkeypatch.setattr(tier.comm, "any_true", any_true)
        assert tier.load(50) is None and votes == [(False,)]  # this rank had it, and still falls back


def test_copies_are_sent_under_the_generation_of_the_restore() -> None:
    with _store() as store:
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        tier.keep_only(40)
        tier.buddy = 0
        tier.copy(50, {"w": torch.ones(2)}, {"r": torch.tensor([1])}, budget_s=60)
        entries: list[Any] = Link(KEY).listing(store)
        # a node's local rank 0 sends its full copy and its own state alone (for a restore of another copy)
        assert [(e[2], e[3], e[6]) for e in entries] == [(50, "full", tier.generation), (50, "rank", tier.generation)]
        when, step = tier.generation.split("-")
        assert step == "40" and int(when) > 0  # after every generation seen (at least rank 0's clock), the step restored


def test_a_run_shrunk_to_one_node_still_restores_from_its_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.training_helpers import RDZV_TEST_KEY
    from training.ckpt.peer.tier import open_tier

    with _store() as store:
        _put(Link(KEY), store, 50, 5.0, 1, "0-40")
        monkeypatch.setenv("GTS_PEER_STORE", store)
        monkeypatch.setenv("RDZV_KEY", RDZV_TEST_KEY)
        monkeypatch.setenv("PEER_EVERY", "10")
        tier = open_tier(Comm("torchrun"))  # one node: nobody to send to, its own store to read
        assert tier is not None and tier.buddy is None and not tier.due(60)
        loaded = tier.load(50)
        assert tier.steps() == {50} and loaded is not None and float(loaded[0]["w"][0]) == 5.0
