"""Issue 46: a round formed after a loss completes as soon as every node of the last round is back
or known lost, instead of waiting its last call (training/node/rdzv_liveness.py); a cold start,
a round that lost no one, and a round one of whose old nodes is not back yet keep the last call.
The holders are torch's own over a real TCPStore; the end-to-end cases run torch's real
rendezvous handlers, one per thread, with a last call far longer than their join timeout: only
the cut lets them finish."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (RendezvousSettings, RendezvousTimeout,
                                                                     _BackendRendezvousStateHolder, _NodeDesc)

from tests.rdzv_helpers import listening_port, refused_port, tcp_store
from training.node import rdzv_liveness
from training.node import rdzv_launch
from training.node.rdzv_launch import SignedC10dBackend

KEY = b"k" * 40
RUN = "run-lc"
LAST_CALL_S = 600  # far past every join timeout below: a round that waits it fails the test


@pytest.fixture()
def store() -> Iterator[TCPStore]:
    yield tcp_store(30)


@pytest.fixture()
def listening() -> Iterator[int]:
    with listening_port() as port:
        yield port


@pytest.fixture()
def closed() -> int:
    return refused_port()


def _node(i: int) -> _NodeDesc:
    return _NodeDesc("127.0.0.1", 2000 + i, 0)


def _holder(store: TCPStore, me: _NodeDesc) -> rdzv_liveness.LivenessStateHolder:
    settings = RendezvousSettings(RUN, 2, 3, RendezvousTimeout(last_call=timedelta(seconds=LAST_CALL_S)),
                                  keep_alive_interval=timedelta(seconds=2), keep_alive_max_attempt=5)
    holder = _BackendRendezvousStateHolder(SignedC10dBackend(store, RUN, KEY), settings)
    holder.__class__ = rdzv_liveness.LivenessStateHolder
    assert isinstance(holder, rdzv_liveness.LivenessStateHolder)
    holder.watch(store, KEY, me, probe=lambda host, port: False)
    return holder


def _stood(holder: rdzv_liveness.LivenessStateHolder, members: list[_NodeDesc], spares: Sequence[_NodeDesc] = ()) -> None:
    """Round 1 complete with `members` (and `spares` held outside it), as this node read it."""
    state, now = holder.state, datetime.now(timezone.utc)
    state.round, state.complete, state.deadline = 1, True, None
    state.participants = {node: rank for rank, node in enumerate(members)}
    state.redundancy_list = set(spares)
    state.last_heartbeats = {node: now for node in [*members, *spares]}
    holder._sanitize()


def _forming(holder: rdzv_liveness.LivenessStateHolder, lost: list[_NodeDesc], back: list[_NodeDesc],
             others: Sequence[_NodeDesc] = ()) -> datetime:
    """`lost` silent past torch's limit and dropped; round 2 forming with `back` in it (`others`
    known to the state but not in it); returns the deadline torch set."""
    state = holder.state
    for node in lost:
        state.last_heartbeats[node] = datetime.now(timezone.utc) - timedelta(seconds=11)
    holder._sanitize()  # torch's own rule drops them
    now = datetime.now(timezone.utc)
    state.round, state.complete, state.redundancy_list, state.wait_list = 2, False, set(), set(others)
    state.participants = {node: 0 for node in back}
    state.last_heartbeats = {node: now for node in [*back, *others]}
    state.deadline = now + timedelta(seconds=LAST_CALL_S)
    return state.deadline


def test_a_round_with_every_old_node_back_or_lost_completes_now(store: TCPStore,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    me, peer, gone = _node(0), _node(1), _node(2)
    holder = _holder(store, me)
    _stood(holder, [me, peer, gone])
    waited = _forming(holder, [gone], [me, peer])
    holder._sanitize()
    assert holder.state.deadline is not None and holder.state.deadline < waited - timedelta(seconds=LAST_CALL_S - 60)
    assert holder._dirty  # written for the others by the next sync
    assert "the round completes now, not after its last call" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["cold start", "no one lost", "an old member not back", "a spare not back",
                                  "a node waiting outside the round"])
def test_a_round_that_may_still_gain_a_node_keeps_its_last_call(store: TCPStore, case: str) -> None:
    me, peer, gone, spare, late = (_node(i) for i in range(5))
    holder = _holder(store, me)
    if case != "cold start":
        _stood(holder, [me, peer, gone], spares=[spare] if case == "a spare not back" else [])
    lost, back = ([], [me, peer, gone]) if case == "no one lost" else ([gone], [me, peer])
    if case == "an old member not back":
        lost, back = [gone], [me, spare]  # peer, alive, has not joined again yet
    waited = _forming(holder, lost, back, others=[late] if case == "a node waiting outside the round" else [])
    holder._sanitize()
    assert holder.state.deadline == waited


def _handler(server: TCPStore, peer_port: int | None, monkeypatch: pytest.MonkeyPatch, misses: int = 30) -> Any:
    """An agent's handler as rdzv_launch makes it, on its own connection to the run's store;
    `peer_port` None: a run without the peer tier."""
    monkeypatch.setenv(rdzv_launch.KEY_VAR, KEY.decode())
    if peer_port is None:
        monkeypatch.delenv(rdzv_liveness.ENDPOINT_VAR, raising=False)
    else:
        monkeypatch.setenv(rdzv_liveness.ENDPOINT_VAR, f"127.0.0.1:{peer_port}")
    params = RendezvousParameters(backend="c10d", endpoint=f"{server.host}:{server.port}", run_id=RUN, min_nodes=2,
                                  max_nodes=3, is_host="false", join_timeout="120", last_call_timeout=str(LAST_CALL_S),
                                  keep_alive_interval="1", keep_alive_max_attempt=str(misses))
    return rdzv_launch.create_signed_handler(params)


def _together(handlers: list[Any]) -> list[int]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return [info.world_size for info in pool.map(lambda h: h.next_rendezvous(), handlers)]


@pytest.mark.parametrize("spare", [False, True])
def test_torch_s_handlers_reform_after_a_node_is_lost_without_the_last_call(
        store: TCPStore, listening: int, spare: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes form round 1 (full: no last call); one stops beating and its peer store refuses;
    the two survivors (and a spare held outside the full round) call next_rendezvous as agents do
    after their workers fail. torch's own rule would drop the lost node after 30 s and then wait
    a 600 s last call; the join timeout is 120 s."""
    dying = socket.create_server(("127.0.0.1", 0))  # the lost node's peer store: listening, then gone
    ports = (listening, listening, dying.getsockname()[1], listening)[:4 if spare else 3]
    nodes = [_handler(store, port, monkeypatch) for port in ports]
    members, waiting = nodes[:3], nodes[3:]
    try:
        with ThreadPoolExecutor(4) as pool:
            first = pool.map(lambda h: h.next_rendezvous(), members)
            assert [info.world_size for info in first] == [3, 3, 3]
            held = [pool.submit(h.next_rendezvous) for h in waiting]  # a spare: the round is full
            lost = members[2]
            lost._stop_heartbeats()
            dying.close()
            again = _together([members[0], members[1]]) if not spare else None
            if spare:
                survivors = pool.map(lambda h: h.next_rendezvous(), members[:2])
                sizes = [info.world_size for info in survivors] + [held[0].result(timeout=180).world_size]
                assert sizes == [3, 3, 3]  # the spare took the lost node's place in the same round
            else:
                assert again == [2, 2]
    finally:
        for handler in nodes:
            handler._stop_heartbeats()


def test_a_node_dropped_that_joined_again_is_lost_no_more(store: TCPStore) -> None:
    """Dropped by torch's rule while its agent lived (stalled), it joins again and round 2 stands
    with it; a later restart that lost no one, with that node between its exit and its join,
    keeps the last call."""
    me, peer, back = _node(0), _node(1), _node(2)
    holder = _holder(store, me)
    _stood(holder, [me, peer, back])
    _forming(holder, [back], [me, peer])
    state, now = holder.state, datetime.now(timezone.utc)
    state.round, state.complete, state.deadline = 2, True, None
    state.participants = {me: 0, peer: 1, back: 2}
    state.last_heartbeats = {node: now for node in (me, peer, back)}
    holder._sanitize()
    state.round, state.complete = 3, False
    state.participants, state.last_heartbeats = {me: 0, peer: 0}, {me: now, peer: now}
    state.deadline = waited = now + timedelta(seconds=LAST_CALL_S)
    holder._sanitize()
    assert holder.state.deadline == waited


def test_without_the_peer_tier_a_node_lost_by_torch_s_rule_ends_the_last_call_too(
        store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """No peer store to ask: the lost node leaves by torch's keep-alive rule (1 s x 3 here), and
    the round re-formed without it completes then, not after a 600 s last call."""
    nodes = [_handler(store, None, monkeypatch, misses=3) for _ in range(3)]
    try:
        assert _together(nodes) == [3, 3, 3]
        nodes[2]._stop_heartbeats()
        assert _together(nodes[:2]) == [2, 2]
    finally:
        for handler in nodes:
            handler._stop_heartbeats()
