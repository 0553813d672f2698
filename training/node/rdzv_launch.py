"""torchrun with a rendezvous whose state is signed: `python -m training.node.rdzv_launch` takes
torchrun's arguments and adds the rendezvous backend `gts-c10d`, torch's c10d backend on the
same TCPStore with every state it writes sealed, and every state it reads checked, with an
HMAC-SHA256 under the run's key (RDZV_KEY; the stack makes one per node group and gives it to
that group's nodes or pods only).

Why: torch's agents unpickle the rendezvous state they read from the store
(dynamic_rendezvous.py, `_RendezvousStateHolder.sync`), and the store has no authentication and
lists its keys (`TCPStore.list_keys`), so a secret run id would not hide a run: anyone who
reaches the store could write a pickled payload under a run's key and have it run in every
node's agent. Here a state without this run's signature is refused before it is unpickled.
A group without the key can still disturb the store (delete keys, fill it); that is kept out by
the network (the store admits its own group's nodes only).

The workers' own store (the one `init_process_group` meets at, MASTER_ADDR:MASTER_PORT) is
hosted by the rank-0 node's agent, bound to that node's private address (`--local-addr`), never
the wildcard, and made anew every rendezvous round on a fresh port, so a new world never reads
an earlier round's keys (what made a joining node wait forever, pytorch/pytorch#135712, when
torch kept one agent store across rounds). torch's TCPStore has no authentication to turn on:
who reaches that port and the collectives' ports is the network's to decide (each multi-node
group's run security group admits its own nodes alone, docs/tenancy.md).

Warm spares (nodeGroups[].scaling.spares): the group runs k nodes more than the run's world
(NNODES, the rendezvous' max_nodes). What torch 2.13's dynamic rendezvous does with them, read
in torch/distributed/elastic/rendezvous/dynamic_rendezvous.py and checked with real processes
(tests/test_spares.py): a node that arrives when the round is complete with max_nodes
participants is put on the round's redundancy list (`_RendezvousJoinOp.__call__`, lines
925-936; `_add_to_redundancy_list`, 765-773); `num_nodes_waiting` counts the wait list only
(1265-1271), and the running agents restart their workers only when it is above 0
(agent/server/api.py 959-970), so a spare disturbs no running world. When a member is lost (its
agent's heartbeat expires, `_BackendRendezvousStateHolder._sanitize`, 480-512, or the survivors
leave the round to restart) the participants drop below max_nodes and the spare leaves the
redundancy list (878-899, its join deadline renewed) and joins the next round, so the world comes
back at max_nodes without a shrink; the group's autoscaling replaces the lost instance, which
comes up as the next spare. A world below max_nodes (a shrink with no spare) takes a newcomer
as a member (the wait list), as before. torch logs none of this above debug level, so
`SpareEvents` says it on the node's log.

    RDZV_KEY=... python -m training.node.rdzv_launch --nnodes 2:4 --rdzv-backend gts-c10d \\
        --rdzv-endpoint 10.0.0.10:29400 --rdzv-id run-1 -m training.trainer.train
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousGracefulExitError,
                                                     RendezvousStateError)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, _create_tcp_store
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler,
                                                                     _DistributedRendezvousOpExecutor, create_handler)

from training.node import rdzv_liveness, warm_launch
from training.node.rdzv_store import listen

BACKEND = "gts-c10d"
KEY_VAR = "RDZV_KEY"
MIN_KEY_CHARS = 32
TAG = b"gts-hmac-v1:"
DIGEST = hashlib.sha256().digest_size


class SignedC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend, with the state sealed on write and checked on read."""

    def __init__(self, store: Any, run_id: str, key: bytes) -> None:
        self._mac_key = key
        self._run = run_id.encode()
        super().__init__(store, run_id)

    @property
    def name(self) -> str:
        return BACKEND

    def seal(self, state: bytes) -> bytes:
        return TAG + hmac.new(self._mac_key, self._run + b"\0" + state, hashlib.sha256).digest() + state

    def open(self, sealed: bytes) -> bytes:
        """The state, if this run's key signed it; else RendezvousStateError (never unpickled)."""
        mac, state = sealed[len(TAG):len(TAG) + DIGEST], sealed[len(TAG) + DIGEST:]
        good = hmac.new(self._mac_key, self._run + b"\0" + state, hashlib.sha256).digest()
        if not sealed.startswith(TAG) or not hmac.compare_digest(mac, good):
            raise RendezvousStateError("the rendezvous state in the store is not signed with this run's key "
                                       f"({KEY_VAR}); refusing to read it")
        return state

    def get_state(self) -> tuple[bytes, Any] | None:
        found = super().get_state()
        if found is None:
            return None
        sealed, token = found
        return self.open(sealed), token

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        written = super().set_state(self.seal(state), token)
        if written is None:
            return None
        sealed, new_token, _ = written
        current = self.open(sealed)
        return current, new_token, current == state


class PrivateWorkerStoreHandler(DynamicRendezvousHandler):
    """torch's handler with the workers' store hosted by the agent on this node's address alone,
    made anew each round (see the module docstring)."""

    def next_rendezvous(self) -> Any:
        # torch builds the bootstrap store when it has none (rendezvous.api RendezvousStoreInfo):
        # forget last round's, so rank 0 hosts a new one and every rank reads its address anew.
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        try:
            info = super().next_rendezvous()
        except RendezvousClosedError:
            if getattr(self, "_gts_joined", False):  # a member of this run: its failure is its own to report
                raise
            # A node that never joined this run's world (a spare or a recreated Job pod scheduled
            # after the run ended): torch refuses it with RendezvousClosedError (dynamic_rendezvous.py
            # `_RendezvousJoinOp.__call__` 876-881, ERROR_CLOSED, raised at 676-677), which would fail
            # the unit or the Job's index after a run that succeeded. Nothing ran here.
            print("rdzv_launch: the run's rendezvous was already closed when this node came (it never joined "
                  "the run); nothing to do", file=sys.stderr, flush=True)
            raise SystemExit(0) from None
        except RendezvousGracefulExitError:
            # A spare still waiting when the run ends: torch tells it the rendezvous closed
            # (dynamic_rendezvous.py `_RendezvousJoinOp.__call__`, 876-881), its agent logs that and
            # returns no result, which torch's launcher then reads as a crash (launcher/api.py 374-378:
            # `result.is_failed()` on None). Nothing ran here: the node ends with 0, as its members did.
            print("rdzv_launch: the run ended while this node waited as a spare; nothing to do", file=sys.stderr,
                  flush=True)
            raise SystemExit(0) from None
        self._gts_joined = True
        return info

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from torch._C

        sock = listen(master_addr, master_port)
        try:
            server = TCPStore(master_addr, sock.getsockname()[1], is_master=True, multi_tenant=True,
                              wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the descriptor now and closes it with the store
        return server


class SpareEvents(_DistributedRendezvousOpExecutor):
    """torch's executor of rendezvous actions, saying on the node's log when this node is held
    as a spare (the round is full) and when it leaves that list to take a lost member's place
    (see the module docstring); the actions themselves are torch's, unchanged."""

    def _add_to_redundancy_list(self) -> None:
        super()._add_to_redundancy_list()
        print(f"rdzv_launch: held as a spare: round {self._state.round} of the run is full "
              f"({len(self._state.participants)} of {self._settings.max_nodes} nodes); this node waits "
              "outside the run and takes the place of the first member lost", file=sys.stderr, flush=True)

    def _remove_from_redundancy_list(self) -> None:
        super()._remove_from_redundancy_list()
        print(f"rdzv_launch: the spare leaves the redundancy list: the run has {len(self._state.participants)} "
              f"of {self._settings.max_nodes} nodes; joining its next round", file=sys.stderr, flush=True)


def run_key(env: dict[str, str] | None = None) -> bytes:
    """The run's key from the environment, or an error naming the variable."""
    value = (env if env is not None else dict(os.environ)).get(KEY_VAR, "")
    if len(value) < MIN_KEY_CHARS:
        raise SystemExit(f"rdzv_launch: {KEY_VAR} must hold the run's rendezvous key (at least {MIN_KEY_CHARS} "
                         "characters; the stack gives each node group its own)")
    return value.encode()


def create_signed_handler(params: RendezvousParameters) -> RendezvousHandler:
    store = _create_tcp_store(params)
    key = run_key()
    handler = create_handler(store, SignedC10dBackend(store, params.run_id, key), params)
    # torch's factory parses the rendezvous settings and builds its own class; ours only adds
    # the two methods above (no state of its own), so the built handler becomes one.
    handler.__class__ = PrivateWorkerStoreHandler
    handler._op_executor.__class__ = SpareEvents  # same for the executor: two methods say more
    # With the peer tier, a member whose peer store refuses connections is dropped at once.
    rdzv_liveness.attach(handler, store, key, os.environ.get(rdzv_liveness.ENDPOINT_VAR, ""))
    return handler


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):  # asking how it works needs no key
        print(__doc__.strip() + "\n\nThe rest of its arguments are torchrun's (`torchrun --help`).")
        return
    run_key()  # no key, no start: the run never falls back to an unsigned rendezvous
    # The agent hosts the workers' store (PrivateWorkerStoreHandler); torch's opt-out would have
    # the rank-0 worker host one on every interface instead.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"
    rendezvous_handler_registry.register(BACKEND, create_signed_handler)
    from torch.distributed.run import main as torchrun, parse_args

    # workers forked from a process that holds torch already (training/node/warm.py)
    warm_launch.start(parse_args(args).no_python)  # type: ignore[no-untyped-call]
    torchrun(args)


if __name__ == "__main__":
    main()
