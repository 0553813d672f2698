"""A lost node leaves the rendezvous when it is known to be gone, not only when its heartbeats
have been missing for keep_alive_interval x keep_alive_max_attempt (10 s by default here).

torch's dynamic rendezvous drops a member only by the age of its last heartbeat
(dynamic_rendezvous.py `_BackendRendezvousStateHolder._sanitize`); until then the survivors of a
crashed node wait on the wait list of a round that still counts it (`_RendezvousJoinOp`), and the
time from the loss to the first resumed step is mostly that wait (docs/recovery.md). A run with
the peer tier has a second witness on every node: its peer store (training/ckpt/peer/store.py), a
process beside the agent on the node's own address. Each agent publishes that address in the
rendezvous store, signed under the run's key (RDZV_KEY) like the rendezvous state; a member whose
heartbeat is older than LATE_BEATS intervals AND whose peer store *refuses* a TCP connection
(the kernel answered: nothing listens there, so the node's processes are gone) is dropped at
once. An agent whose workers failed (the run's collective broke) and that waits for the round it
left to end asks the round's remaining members at once, whatever their heartbeat's age: the
failure is the first sign there, and a refusal is still needed. Both must hold: a slow agent
keeps its store. Anything short of a refusal (a timeout: a
host that vanished, a firewall that drops, no published address, a signature that does not
match) leaves torch's own rule to decide, so a node is never dropped earlier on weaker evidence
than torch's. (A host firewall that REJECTs the port also answers "refused": the run's own
security group admits PEER_PORT between its nodes, docs/tenancy.md.) The late members are asked
together, within one short budget per sync, so a wave of vanished hosts costs one timeout, not
one each; a member past torch's own limit is left to it. A verdict holds for the silence it was
about: a dropped node that beats again (it joins anew) is a member like any other. A node whose
own store refuses (the store died beside a live agent; nothing restarts it) withdraws its address,
so no other agent takes that refusal as its loss. The probe only connects and closes (the store
reads no request from it) and only to a port the run already opens between its nodes (PEER_PORT).

A round formed after a loss also skips its last call when no one is missing: torch waits
last_call_timeout once MIN_NNODES are in, for nodes that may still come (`_RendezvousJoinOp`);
when every node the rendezvous knew while its last round stood (members, spares, waiting nodes)
is back in the new round or is known to be lost (dropped from this node's view of the state, by
the probe above or by torch's own rule), and no other node is known, nothing is left to wait for
and the deadline is moved to now. A cold start, a round that lost no one, and a round one of
whose old nodes is in transit (a spare between its lists, a survivor slow to rejoin) keep the
last call. A replacement that boots later joins as a waiting node and restarts the run, as it
would have after the last call. This holds for runs without the peer tier too (no store to ask:
members are lost by torch's keep-alive rule alone), whose last call is torch's 30 s.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

ENDPOINT_VAR = "GTS_PEER_STORE"  # host:port of this node's peer store (training/node/entrypoint.sh)
LATE_BEATS = 1.5  # a heartbeat this many intervals old makes a member worth asking about
PROBE_TIMEOUT_S = 0.5
TAG = b"gts-live-v1:"
DIGEST = hashlib.sha256().digest_size
EPOCH = datetime.min.replace(tzinfo=timezone.utc)


def key(run_id: str, node: Any) -> str:
    return f"gts.live.{run_id}.{node!r}"


def seal(mac_key: bytes, run_id: str, node: Any, endpoint: str) -> bytes:
    body = f"{run_id}\0{node!r}\0{endpoint}".encode()
    return TAG + hmac.new(mac_key, body, hashlib.sha256).digest() + endpoint.encode()


def opened(mac_key: bytes, run_id: str, node: Any, sealed: bytes) -> tuple[str, int] | None:
    """The (host, port) that `node` published for this run under this key; None for anything else."""
    if not sealed.startswith(TAG) or len(sealed) <= len(TAG) + DIGEST:
        return None
    mac, raw = sealed[len(TAG):len(TAG) + DIGEST], sealed[len(TAG) + DIGEST:]
    try:
        endpoint = raw.decode()
    except UnicodeDecodeError:
        return None
    good = hmac.new(mac_key, f"{run_id}\0{node!r}\0{endpoint}".encode(), hashlib.sha256).digest()
    return parse(endpoint) if hmac.compare_digest(mac, good) else None


def parse(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `[v6]:port`; None for anything else."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def refused(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when the host answered that nothing listens on the port (a TCP reset)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout, no route, a name that does not resolve: no evidence either way
        return False


def publish(store: Any, mac_key: bytes, run_id: str, node: Any, endpoint: str) -> None:
    store.set(key(run_id, node), seal(mac_key, run_id, node, endpoint))


class LivenessStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, asking a late member's peer store before torch's keep-alive rule runs.
    Made by class swap (training/node/rdzv_launch.py create_signed_handler), then `watch`ed."""

    _gts_store: Any
    _gts_key: bytes
    _gts_self: Any
    _gts_own: tuple[str, int] | None
    _gts_own_asked: float
    _gts_asked: dict[str, float]
    _gts_gone: dict[str, datetime]
    _gts_probe: Callable[[str, int], bool]
    _gts_budget_s: float
    _gts_round: int
    _gts_known: set[str]
    _gts_lost: set[str]

    def watch(self, store: Any, mac_key: bytes, this_node: Any, own: tuple[str, int] | None = None,
              probe: Callable[[str, int], bool] = refused, budget_s: float = PROBE_TIMEOUT_S + 0.2) -> None:
        """`own`: this node's published store, asked too (a node whose own store is down withdraws
        its address); `budget_s`: the most one sync spends on probes, all asked at once."""
        self._gts_store, self._gts_key, self._gts_self, self._gts_own = store, mac_key, this_node, own
        self._gts_own_asked, self._gts_asked, self._gts_gone = 0.0, {}, {}
        self._gts_probe, self._gts_budget_s = probe, budget_s
        self._gts_round, self._gts_known, self._gts_lost = -1, set(), set()

    def _endpoint(self, node: Any) -> tuple[str, int] | None:
        name = key(self._settings.run_id, node)
        try:
            if not self._gts_store.check([name]):  # get() would wait for a key never written
                return None
            return opened(self._gts_key, self._settings.run_id, node, bytes(self._gts_store.get(name)))
        except Exception:  # noqa: BLE001 (the store unreachable: torch's own sync reports that)
            return None

    def _late(self, now: datetime) -> dict[Any, datetime]:
        """Members worth asking about: late by LATE_BEATS intervals, not yet past torch's own limit
        (its rule drops those below), not this node, not asked within the last interval. While
        this node waits for the round it left to end (its workers failed: the run's collective
        broke), the round's remaining members are asked at any age: that failure is the sign a
        late heartbeat otherwise gives, and only a refusal drops one."""
        interval = self._settings.keep_alive_interval
        expiry = interval * self._settings.keep_alive_max_attempt
        state = self._state
        after_failure = state.complete and self._gts_self in state.wait_list
        least, asked = ((timedelta.min, state.participants) if after_failure
                        else (interval * LATE_BEATS, state.last_heartbeats))
        late = {node: beat for node, beat in state.last_heartbeats.items()
                if node != self._gts_self and node in asked and least <= now - beat < expiry
                and time.monotonic() - self._gts_asked.get(repr(node), 0.0) >= interval.total_seconds()}
        for node in late:
            self._gts_asked[repr(node)] = time.monotonic()
        return late

    def _refused(self, nodes: dict[Any, datetime]) -> dict[Any, datetime]:
        """The nodes among `nodes` whose stores refuse, asked all at once within the budget: a host
        that drops packets costs one timeout for all, not one each."""
        asks = {node: at for node in nodes if (at := self._endpoint(node)) is not None}
        if not asks:
            return {}
        pool = ThreadPoolExecutor(max_workers=min(16, len(asks)), thread_name_prefix="gts-liveness")
        futures = {pool.submit(self._gts_probe, *at): node for node, at in asks.items()}
        done, _ = wait(futures, timeout=self._gts_budget_s)
        pool.shutdown(wait=False, cancel_futures=True)
        return {futures[f]: nodes[futures[f]] for f in done if f.exception() is None and f.result()}

    def _withdraw_if_own_store_is_down(self) -> None:
        """This node's own store refusing (it died beside a live agent): its address is withdrawn,
        so that no other agent takes the refusal as this node's loss (torch's rule stays)."""
        interval = self._settings.keep_alive_interval.total_seconds()
        if self._gts_own is None or time.monotonic() - self._gts_own_asked < interval:
            return
        self._gts_own_asked = time.monotonic()
        if not self._gts_probe(*self._gts_own):
            return
        try:
            self._gts_store.delete_key(key(self._settings.run_id, self._gts_self))
        except Exception:  # noqa: BLE001 (the store unreachable: asked again next interval)
            return
        self._gts_own = None
        print("rdzv_launch: this node's own peer store refuses connections: its address is withdrawn from the "
              "rendezvous (its loss is left to torch's keep-alive rule)", file=sys.stderr, flush=True)

    def _end_last_call_if_none_is_missing(self) -> None:
        """A forming round whose old nodes are all back or lost completes now (module docstring)."""
        state, now = self._state, datetime.now(timezone.utc)
        if state.complete or state.deadline is None or state.deadline <= now or not self._gts_known & self._gts_lost:
            return
        present = {repr(node) for node in state.participants}
        if len(present) < self._settings.min_nodes or {repr(node) for node in state.last_heartbeats} - present \
                or self._gts_known - present - self._gts_lost:
            return
        state.deadline = now
        self.mark_dirty()
        print(f"rdzv_launch: round {state.round}: every node of the last round is back ({len(present)}) or lost "
              f"({len(self._gts_known & self._gts_lost)}): the round completes now, not after its last call",
              file=sys.stderr, flush=True)

    def _sanitize(self) -> None:
        watching = getattr(self, "_gts_store", None) is not None
        if watching and self._state.complete:  # every node seen while the round stood: the next one waits for them
            standing = {repr(node) for node in self._state.last_heartbeats}
            if self._state.round != self._gts_round:  # a new round stands: what was lost before is of no use
                self._gts_round, self._gts_known, self._gts_lost = self._state.round, standing, set()
            self._gts_known |= standing
        if watching:
            self._withdraw_if_own_store_is_down()
            now = datetime.now(timezone.utc)
            for node, beat in self._refused(self._late(now)).items():
                self._gts_gone[repr(node)] = beat
                print(f"rdzv_launch: node {node!r} is gone (its heartbeat is {(now - beat).total_seconds():.1f} s old "
                      "and its peer store refuses connections): removed from the rendezvous now, not after the "
                      "keep-alive limit", file=sys.stderr, flush=True)
            for node, beat in list(self._state.last_heartbeats.items()):
                seen = self._gts_gone.get(repr(node))
                if seen is not None and beat > seen:  # it beat since: alive after all, judged anew if late again
                    del self._gts_gone[repr(node)]
                elif seen is not None:  # the same silence (a state read back from an agent that kept it)
                    self._state.last_heartbeats[node] = EPOCH  # torch's rule below removes it
                    self.mark_dirty()  # and the next sync writes that down for the others
        super()._sanitize()
        if watching:  # lost: dropped from this node's view; a node in the state again has joined anew
            self._gts_lost = (self._gts_lost - {repr(node) for node in self._state.last_heartbeats}) \
                | {repr(node) for node in self._dead_nodes}
            self._end_last_call_if_none_is_missing()


def attach(handler: Any, store: Any, mac_key: bytes, endpoint: str) -> None:
    """Make the handler's state holder end a last call no one is missing for; with a peer store
    (`endpoint`), publish it and ask late members' too. Without one (a run without the peer tier)
    members are lost by torch's keep-alive rule alone."""
    holder = handler._state_holder
    if not isinstance(holder, _BackendRendezvousStateHolder):
        return
    own = parse(endpoint) if endpoint else None
    if own is not None:
        publish(store, mac_key, handler._settings.run_id, handler._this_node, endpoint)
    holder.__class__ = LivenessStateHolder
    assert isinstance(holder, LivenessStateHolder)
    holder.watch(store, mac_key, handler._this_node, own)
