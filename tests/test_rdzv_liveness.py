"""Issue 46: a member whose peer store refuses connections leaves the rendezvous at once; every
weaker sign leaves torch's keep-alive rule to decide (training/node/rdzv_liveness.py). The
holder is torch's own, over a real TCPStore, with real sockets: one listening, one refusing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (RendezvousSettings, RendezvousTimeout,
                                                                     _BackendRendezvousStateHolder, _NodeDesc)

from tests.rdzv_helpers import listening_port, refused_port, tcp_store
from training.node import rdzv_liveness
from training.node.rdzv_launch import SignedC10dBackend

KEY = b"k" * 40
RUN = "run-1"


@pytest.fixture()
def store() -> Iterator[TCPStore]:
    yield tcp_store(10)


@pytest.fixture()
def listening() -> Iterator[int]:
    with listening_port() as port:
        yield port


@pytest.fixture()
def closed() -> int:
    return refused_port()


def _settings() -> RendezvousSettings:
    return RendezvousSettings(RUN, 1, 4, RendezvousTimeout(), keep_alive_interval=timedelta(seconds=2),
                              keep_alive_max_attempt=5)


def _holder(store: TCPStore, this: _NodeDesc) -> rdzv_liveness.LivenessStateHolder:
    holder = _BackendRendezvousStateHolder(SignedC10dBackend(store, RUN, KEY), _settings())
    holder.__class__ = rdzv_liveness.LivenessStateHolder
    assert isinstance(holder, rdzv_liveness.LivenessStateHolder)
    holder.watch(store, KEY, this)
    return holder


def _member(holder: _BackendRendezvousStateHolder, node: _NodeDesc, age_s: float) -> None:
    holder.state.participants[node] = len(holder.state.participants)
    holder.state.last_heartbeats[node] = datetime.now(timezone.utc) - timedelta(seconds=age_s)


def _recorder(asked: list[tuple[str, int]], verdict: bool) -> Callable[[str, int], bool]:
    def probe(host: str, port: int) -> bool:
        asked.append((host, port))
        return verdict
    return probe


def _node(i: int) -> _NodeDesc:
    return _NodeDesc("127.0.0.1", 1000 + i, 0)


def test_a_late_member_whose_store_refuses_is_dropped_and_no_weaker_sign_drops_one(
        store: TCPStore, listening: int, closed: int, capsys: pytest.CaptureFixture[str]) -> None:
    me, gone, slow, fresh, forged, moved, silent = (_node(i) for i in range(7))
    holder = _holder(store, me)
    rdzv_liveness.publish(store, KEY, RUN, me, f"127.0.0.1:{closed}")  # even refused, this node never drops itself
    rdzv_liveness.publish(store, KEY, RUN, gone, f"127.0.0.1:{closed}")
    rdzv_liveness.publish(store, KEY, RUN, slow, f"127.0.0.1:{listening}")  # a slow agent, its store alive
    rdzv_liveness.publish(store, KEY, RUN, fresh, f"127.0.0.1:{closed}")  # a store restarting, its agent beating
    rdzv_liveness.publish(store, b"another run's key" * 3, RUN, forged, f"127.0.0.1:{closed}")
    replayed: Any = store  # a signed value is bytes; the stub says str
    replayed.set(rdzv_liveness.key(RUN, moved), store.get(rdzv_liveness.key(RUN, gone)))  # gone's signed value, replayed
    for node, age in ((me, 5), (gone, 5), (slow, 5), (fresh, 1), (forged, 5), (moved, 5), (silent, 5)):
        _member(holder, node, age)
    holder._sanitize()
    assert gone not in holder.state.participants and gone not in holder.state.last_heartbeats
    assert set(holder.state.participants) == {me, slow, fresh, forged, moved, silent}
    assert f"node {gone!r} is gone" in capsys.readouterr().err


def test_torch_s_own_keep_alive_rule_still_drops_a_silent_member(store: TCPStore) -> None:
    me, silent = _node(0), _node(1)
    holder = _holder(store, me)
    _member(holder, me, 0)
    _member(holder, silent, 11)  # past 2 s x 5, nothing published: torch's rule, unchanged
    holder._sanitize()
    assert set(holder.state.participants) == {me}


def test_a_member_is_asked_at_most_once_per_interval(store: TCPStore, closed: int) -> None:
    me, late = _node(0), _node(1)
    asked: list[tuple[str, int]] = []
    holder = _holder(store, me)
    holder.watch(store, KEY, me, probe=_recorder(asked, False))
    rdzv_liveness.publish(store, KEY, RUN, late, f"127.0.0.1:{closed}")
    _member(holder, me, 0)
    _member(holder, late, 4)
    holder._sanitize()
    holder._sanitize()
    assert asked == [("127.0.0.1", closed)] and late in holder.state.participants


@pytest.mark.parametrize("sealed", [b"", b"gts-live-v1:", b"gts-live-v1:" + b"\0" * 32 + b"127.0.0.1:1",
                                    b"garbage", b"gts-live-v1:" + b"\0" * 32 + b"\xff\xfe"])
def test_a_value_not_signed_for_this_node_is_no_address(sealed: bytes) -> None:
    assert rdzv_liveness.opened(KEY, RUN, _node(1), sealed) is None


@pytest.mark.parametrize("endpoint", ["127.0.0.1:0", "127.0.0.1:70000", ":29600", "127.0.0.1:", "127.0.0.1:x"])
def test_a_signed_value_that_is_no_address_is_refused(endpoint: str) -> None:
    assert rdzv_liveness.opened(KEY, RUN, _node(1), rdzv_liveness.seal(KEY, RUN, _node(1), endpoint)) is None


def test_a_signed_address_reads_back_ipv4_and_ipv6() -> None:
    for endpoint, found in (("10.0.1.12:29600", ("10.0.1.12", 29600)), ("[fd00::5]:29600", ("fd00::5", 29600))):
        assert rdzv_liveness.opened(KEY, RUN, _node(1), rdzv_liveness.seal(KEY, RUN, _node(1), endpoint)) == found


def test_a_member_found_gone_stays_gone_for_that_silence_and_the_drop_is_written_for_the_others(
        store: TCPStore, closed: int, capsys: pytest.CaptureFixture[str]) -> None:
    me, gone = _node(0), _node(1)
    asked: list[tuple[str, int]] = []
    holder = _holder(store, me)
    holder.watch(store, KEY, me, probe=_recorder(asked, True))
    rdzv_liveness.publish(store, KEY, RUN, gone, f"127.0.0.1:{closed}")
    _member(holder, me, 0)
    _member(holder, gone, 4)
    silence = holder.state.last_heartbeats[gone]
    holder._sanitize()
    holder.sync()  # the drop marked the state dirty: this writes it
    other = _BackendRendezvousStateHolder(SignedC10dBackend(store, RUN, KEY), _settings())
    other.sync()
    assert set(other.state.participants) == {me}
    _member(holder, gone, 0)  # a state read back from an agent that had not dropped it yet: the same silence
    holder.state.last_heartbeats[gone] = silence
    holder._sanitize()
    assert gone not in holder.state.participants and len(asked) == 1  # dropped again, not asked again
    assert capsys.readouterr().err.count("is gone") == 1


def test_a_member_dropped_that_beats_again_is_not_shut_out(store: TCPStore, closed: int) -> None:
    """A node dropped while alive (its store had died beside a live agent) that joins again with a
    new heartbeat is a member like any other: no verdict outlives the silence it was about."""
    me, back = _node(0), _node(1)
    holder = _holder(store, me)
    holder.watch(store, KEY, me, probe=_recorder([], True))
    rdzv_liveness.publish(store, KEY, RUN, back, f"127.0.0.1:{closed}")
    _member(holder, me, 0)
    _member(holder, back, 4)
    holder._sanitize()
    assert back not in holder.state.participants
    _member(holder, back, 0)  # it joins again and beats
    holder._sanitize()
    assert back in holder.state.participants


def test_a_node_whose_own_store_refuses_withdraws_its_address(store: TCPStore, closed: int, listening: int,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    me, peer = _node(0), _node(1)
    rdzv_liveness.publish(store, KEY, RUN, me, f"127.0.0.1:{closed}")
    mine = _holder(store, me)
    mine.watch(store, KEY, me, own=("127.0.0.1", closed))
    _member(mine, me, 0)
    mine._sanitize()
    assert not store.check([rdzv_liveness.key(RUN, me)])  # withdrawn: its store's refusal is no evidence now
    assert "its address is withdrawn" in capsys.readouterr().err
    theirs = _holder(store, peer)
    _member(theirs, peer, 0)
    _member(theirs, me, 4)  # late, its store refusing: still a member (torch's rule decides)
    theirs._sanitize()
    assert me in theirs.state.participants
    alive = _holder(store, peer)
    alive.watch(store, KEY, peer, own=("127.0.0.1", listening))
    rdzv_liveness.publish(store, KEY, RUN, peer, f"127.0.0.1:{listening}")
    alive._sanitize()
    assert store.check([rdzv_liveness.key(RUN, peer)])  # a store that listens keeps its address


def test_late_members_are_asked_at_once_and_those_past_torch_s_limit_not_at_all(store: TCPStore, closed: int) -> None:
    """Three silent hosts cost one wait, not three: each probe waits for the other two (a barrier),
    which only probes asked together pass."""
    me, past = _node(0), _node(9)
    late = [_node(i) for i in (1, 2, 3)]
    together = threading.Barrier(3, timeout=60)
    asked: list[tuple[str, int]] = []

    def probe(host: str, port: int) -> bool:
        asked.append((host, port))
        together.wait()
        return True
    holder = _holder(store, me)
    holder.watch(store, KEY, me, probe=probe, budget_s=120)
    _member(holder, me, 0)
    for node in [*late, past]:
        rdzv_liveness.publish(store, KEY, RUN, node, f"127.0.0.1:{closed}")
        _member(holder, node, 11 if node == past else 4)
    holder._sanitize()
    assert set(holder.state.participants) == {me} and len(asked) == 3  # `past`: torch's rule, never asked


def test_an_agent_waiting_after_its_workers_failed_asks_the_round_s_members_at_any_age(
        store: TCPStore, listening: int, closed: int) -> None:
    """Its workers failed and it left the round (now on the wait list of the round still
    standing): the remaining members are asked at once, and only a refusal drops one. In steady
    state (a member itself) the same fresh heartbeats are not asked about."""
    me, gone, alive = _node(0), _node(1), _node(2)
    rdzv_liveness.publish(store, KEY, RUN, gone, f"127.0.0.1:{closed}")
    rdzv_liveness.publish(store, KEY, RUN, alive, f"127.0.0.1:{listening}")
    steady = _holder(store, me)
    for node in (me, gone, alive):
        _member(steady, node, 0.5)
    steady.state.complete = True
    steady._sanitize()
    assert set(steady.state.participants) == {me, gone, alive}
    waiting = _holder(store, me)
    for node in (gone, alive):
        _member(waiting, node, 0.5)
    waiting.state.complete = True
    waiting.state.wait_list = {me}
    waiting.state.last_heartbeats[me] = datetime.now(timezone.utc)
    waiting._sanitize()
    assert set(waiting.state.participants) == {alive}
