"""A lost node leaves the rendezvous when it is known to be gone, not only when its heartbeats
have been missing for keep_alive_interval x keep_alive_max_attempt (10 s by default here).

torch's dynamic rendezvous drops a member only by the age of its last heartbeat
(dynamic_rendezvous.py `_BackendRendezvousStateHolder._sanitize`); until then the survivors of a
crashed node wait on the wait list of a round that still counts it (`_RendezvousJoinOp`), and the
time from the loss to the first resumed step is mostly that wait (docs/recovery.md). A run with
the peer tier has a second witness on every node: its peer store (training/peer/store.py), a
process beside the agent on the node's own address. Each agent publishes that address in the
rendezvous store, signed under the run's key (RDZV_KEY) like the rendezvous state; a member whose
heartbeat is older than LATE_BEATS intervals AND whose peer store *refuses* a TCP connection
(the kernel answered: nothing listens there, so the node's processes are gone) is dropped at
once. Both must hold: a slow agent keeps its store, a restarting store keeps the agent's
heartbeats. Anything short of a refusal (a timeout: a host that vanished, a firewall that drops,
no published address, a signature that does not match) leaves torch's own rule to decide, so a
node is never dropped earlier on weaker evidence than torch's. The probe only connects and
closes (the store reads no request from it) and only to a port the run already opens between its
nodes (PEER_PORT).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import sys
import time
from datetime import datetime, timezone
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
    host, _, port = endpoint.rpartition(":")
    if not hmac.compare_digest(mac, good) or not host or not port.isdigit() or not 0 < int(port) < 65536:
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
    _gts_asked: dict[str, float]
    _gts_gone: set[str]
    _gts_probe: Callable[[str, int], bool]

    def watch(self, store: Any, mac_key: bytes, this_node: Any, probe: Callable[[str, int], bool] = refused) -> None:
        self._gts_store, self._gts_key, self._gts_self = store, mac_key, this_node
        self._gts_asked, self._gts_gone, self._gts_probe = {}, set(), probe

    def _endpoint(self, node: Any) -> tuple[str, int] | None:
        name = key(self._settings.run_id, node)
        try:
            if not self._gts_store.check([name]):  # get() would wait for a key never written
                return None
            return opened(self._gts_key, self._settings.run_id, node, bytes(self._gts_store.get(name)))
        except Exception:  # noqa: BLE001 (the store unreachable: torch's own sync reports that)
            return None

    def _gone(self, node: Any, beat: datetime, now: datetime) -> bool:
        interval = self._settings.keep_alive_interval
        if node == self._gts_self or now - beat < interval * LATE_BEATS:
            return False
        asked = self._gts_asked.get(repr(node), 0.0)
        if time.monotonic() - asked < interval.total_seconds():  # once per interval at most
            return False
        self._gts_asked[repr(node)] = time.monotonic()
        endpoint = self._endpoint(node)
        return endpoint is not None and self._gts_probe(*endpoint)

    def _sanitize(self) -> None:
        if getattr(self, "_gts_store", None) is not None:
            now = datetime.now(timezone.utc)
            for node, beat in list(self._state.last_heartbeats.items()):
                # A node found gone stays gone (an agent that starts again is a new node, with a
                # new pid): a state read back from a node that had not dropped it yet drops it again.
                if repr(node) in self._gts_gone or self._gone(node, beat, now):
                    if repr(node) not in self._gts_gone:
                        self._gts_gone.add(repr(node))
                        age = (now - beat).total_seconds()
                        print(f"rdzv_launch: node {node!r} is gone (its heartbeat is {age:.1f} s old and its peer "
                              "store refuses connections): removed from the rendezvous now, not after the keep-alive "
                              "limit", file=sys.stderr, flush=True)
                    self._state.last_heartbeats[node] = EPOCH  # torch's rule below removes it
                    self.mark_dirty()  # and the next sync writes that down for the others
        super()._sanitize()


def attach(handler: Any, store: Any, mac_key: bytes, endpoint: str) -> None:
    """Publish this node's peer store and make the handler's state holder ask late members'."""
    holder = handler._state_holder
    if not isinstance(holder, _BackendRendezvousStateHolder) or not endpoint:
        return
    publish(store, mac_key, handler._settings.run_id, handler._this_node, endpoint)
    holder.__class__ = LivenessStateHolder
    assert isinstance(holder, LivenessStateHolder)
    holder.watch(store, mac_key, handler._this_node)
