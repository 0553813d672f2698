"""The peer tier in a training process: every PEER_EVERY steps this rank's state is staged into
host memory (the loop's only wait) and sent, on a background thread, to the peer store of its
buddy node (training/ckpt/peer/store.py); after a loss, `steps` and `load` give what the surviving
stores hold, for training/ckpt/run_control.py's choose_checkpoint (peer first, then disk, then bucket).

The buddies: node n's copies go to a node in another zone (GTS_ZONE) when the run spans zones,
dealt so that each node holds about as many as it sends (buddy()), else to node n+1; never to
node n itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from training import contract
from training.ckpt.manager import CheckpointManager
from training.ckpt.files import CheckpointError
from training.distributed import Comm
from training.ckpt.peer import history, share, wire
from training.ckpt.peer.client import Link, PeerRefused
from training.ckpt.peer.ring import buddy, node_zone
from training.ckpt.run_control import Resumed, choose_checkpoint
from training.ckpt.staging import Stager

log = logging.getLogger("gts.peer")
ADDR_VAR = wire.ADDR_VAR  # (in wire.py: the trainer reads it before torch is imported, training/trainer/early.py)


def start_sender(target: Any, args: tuple[Any, ...], name: str, step: int, start: float,
                 budget_s: float | None) -> threading.Thread:
    """A copy's background sender, started; with `budget_s` (a stop) waited for until that long
    after `start`, and left to finish on its own past it (logged)."""
    sender = threading.Thread(target=target, args=args, name=name, daemon=True)
    sender.start()
    if budget_s is not None:
        sender.join(max(0.0, budget_s - (time.perf_counter() - start)))
        if sender.is_alive():
            log.warning("peer copy of step %d not confirmed within %.0f s of the stop: left to finish on its own",
                        step, budget_s)
    return sender


class PeerTier:
    """One rank's side of the tier (every rank makes one; collectives in __init__). A Tier
    (training/ckpt/tiers.py): `steps` and `load`, the latter collective."""

    name = "peer"

    def __init__(self, comm: Comm, every: int, key: bytes, store: str, zone: str):
        self.comm, self.every = comm, every
        self.link = Link(key)
        nodes = {node: (addr, z) for node, addr, z in comm.all_gather_object((comm.node, store, zone))}
        self.stores = [nodes[n][0] for n in range(comm.nnodes)]
        self.zones = [nodes[n][1] for n in range(comm.nnodes)]  # each node's (sharded copies' holders: shardset)
        self.buddy = buddy(comm.node, self.zones) if comm.nnodes > 1 else None
        self._stager = Stager()
        self._sender: threading.Thread | None = None
        self.blocked_s = 0.0  # the loop's wait for the copies, all of them
        self.sent: list[int] = []
        self.skipped, self.error = 0, ""
        self.refusals: list[str] = []  # peer copies refused (digest), by name
        # <n>-<restored step>: the history this world's copies belong to (keep_only sets it, from rank 0)
        self.generation = "0-0"
        self.restored_world = 0  # the world size of the peer copy this world restored (0: none)
        self.restored_gen = history.DURABLE  # and its generation
        self.seen: set[str] = set()  # every generation the stores listed (history.next_generation)
        self.share_root = share.default_root()  # where a restore's full copy is shared on a node
        # where /dev/shm has no room: the node's scratch (`choose` sets the checkpoint manager's local dir)
        self.share_fallback = os.environ.get(contract.CHECKPOINT_DIR.name) or "out/checkpoints"
        self._started = time.time()  # when this restore began (share.sweep: older directories only)
        self._prefetch: threading.Thread | None = None  # local rank 0's early fetch (prefetch)
        # (step, entry, the stores asked, the checked bytes or None)
        self._prefetched: tuple[int, list[Any], list[str], bytes | None] | None = None
        self._prefetch_dropped = False  # no restore wants it: the fetch ends without keeping what it got

    def due(self, step: int) -> bool:
        return self.every > 0 and self.buddy is not None and step % self.every == 0

    def copy(self, step: int, state: dict[str, Any] | None, rng: dict[str, Any], budget_s: float | None = None
             ) -> float:
        """Stage this rank's state (`state` on a node's local rank 0, else None) and send it to the
        buddy in the background; `budget_s` (a stop, after its durable checkpoint): wait for it, for
        the one before it too, at most that long in all. Returns the seconds blocked."""
        start = time.perf_counter()
        if self._sender is not None and self._sender.is_alive():
            if budget_s is not None:
                self._sender.join(budget_s)
            if self._sender.is_alive():
                self.skipped += 1  # the previous copy is still on its way: this one is left out
                log.info("peer copy of step %d skipped: the one before is still being sent", step)
                return time.perf_counter() - start
        staged = self._stager.stage({"state": state, "rng": rng, "step": step})
        self._sender = start_sender(self._send, (step, staged), "peer-copy", step, start, budget_s)
        return self._blocked(step, start)

    def _blocked(self, step: int, start: float) -> float:
        """The loop's wait for the copy of `step` begun at `start`: counted and logged (rank 0)."""
        blocked = time.perf_counter() - start
        self.blocked_s += blocked
        if self.comm.rank == 0:
            log.info("peer copy of step %d: loop blocked %.3f s", step, blocked)
        return blocked

    def _send(self, step: int, staged: dict[str, Any]) -> None:
        """The staged copy to the buddy's store; a node's local rank 0 sends its own state alone
        too (kind `rank`, small), so that a restore taking another node's full copy gets it
        without a second full fetch."""
        assert self.buddy is not None
        parts = [("rank", {"state": None, "rng": staged["rng"], "step": step})]
        if staged["state"] is not None:
            parts.append(("full", staged))
        size = 0
        for kind, part in parts:
            buffer = io.BytesIO()
            torch.save(part, buffer)
            data = buffer.getbuffer()
            size += len(data)
            try:
                self.link.put(self.stores[self.buddy], self.comm.world, self.comm.rank, step, kind, data,
                              wire.payload_digest(data), self.generation)
            except PeerRefused as exc:
                self.error = str(exc)
                log.warning("peer copy of step %d not sent: %s", step, exc)
                return
        self.sent.append(step)
        if self.comm.rank == 0:
            log.info("peer copy of step %d on node %d (%.1f MiB)", step, self.buddy, size / 2**20)

    def close(self, timeout_s: float | None = None) -> None:
        if self._sender is not None:
            self._sender.join(timeout_s)

    # ------------------------------------------------------------------ recovery
    def _held(self, collective: bool = False) -> list[tuple[str, list[Any]]]:
        """(store, [world, rank, step, kind, digest, size, generation]) of every copy the stores hold
        that belongs to the run's history (training/ckpt/peer/history.py). `collective`: with every
        rank's records, so that a store rank 0 could not list (it picks the copies) still counts."""
        found, records = self.link.held_all(self.stores)
        if collective:
            records = [record for listed in self.comm.all_gather_object(records) for record in listed]
        self.seen |= {str(e[6]) for _, e in found} | {str(r[0]) for r in records}
        return history.current(found, records, time.time())  # none of a history a later restore left

    def steps(self) -> set[int]:
        """Steps this rank can restore from the stores: those with a full copy in some store. Its
        own per-rank state comes back where a store still holds it (`load`); where the step was
        saved by a world of another size, or the copy was on the lost node, the rank goes on with
        re-seeded streams, as the durable path does when the world size changed: a step lost is
        worse than a random stream restarted."""
        return {e[2] for _, e in self._held() if e[3] == "full"}

    def _get(self, step: int, store: str, entry: list[Any]) -> bytes | None:
        """The bytes of the copy `entry` of `store` when they match the digest listed and named;
        else None (refused by name)."""
        world, rank, _, kind, listed, _, gen = entry
        try:
            named, data = self.link.get(store, world, rank, step, kind, gen)
        except PeerRefused as exc:
            log.warning("%s", exc)
            return None
        if wire.payload_digest(data) != named or named != listed:
            self._refuse(f"peer copy of step {step} of rank {rank}/{world} ({kind}) held by {store} does not match "
                         "its digest: refused")
            return None
        return data

    def _refuse(self, why: str) -> None:
        self.refusals.append(why)
        log.warning("%s", why)

    def _fetch(self, step: int, store: str, entry: list[Any]) -> dict[str, Any] | None:
        """The copy `entry` of `store`, loaded, when its bytes match its digest; else None."""
        data = self._get(step, store, entry)
        if data is None:
            return None
        try:
            loaded = dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 (the sender's own bytes, not loadable: every rank must go on)
            log.warning("peer copy of step %d held by %s cannot be loaded: %s", step, store, exc)
            return None
        return loaded if loaded.get("step") == step else None

    @contextlib.contextmanager
    def _node_copy(self, step: int, entry: list[Any], holders: list[str]) -> Iterator[dict[str, Any] | None]:
        """The full copy `entry` on every rank, fetched once per node (collective): the node's
        local rank 0 gets it (`_publish`) and writes it once into a private file (share.py); every
        local rank opens it, and once all hold it open (a barrier) local rank 0 removes it, so that
        no worker killed later leaves it behind; then (a barrier) each checks and loads it from its
        open file."""
        world, rank, _, kind, listed, _, _ = entry
        what = f"peer copy of step {step} of rank {rank}/{world} ({kind})"
        node_copy, fh = None, None
        try:
            node_copy, path = self._publish(step, entry, holders) if self.comm.local_rank == 0 else (None, "")
            path = self.comm.all_gather_object(path)[self.comm.rank - self.comm.local_rank]
            fh, why = share.open_copy(path, what) if path else (None, "")
            self.comm.barrier()  # every rank of the node holds the file open (or refused it)
            if node_copy is not None:
                node_copy.remove()  # the kernel frees the file when the last reader closes it
                node_copy = None
            self.comm.barrier()  # gone before any rank reads it: a kill from here on leaves nothing
            loaded, why = share.load(fh, path, listed, what) if fh is not None else (None, why)
            if why:
                self._refuse(why)
            yield loaded if loaded is not None and loaded.get("step") == step else None
        finally:
            if fh is not None:
                fh.close()
            if node_copy is not None:
                node_copy.remove()

    def _publish(self, step: int, entry: list[Any], holders: list[str]) -> tuple[share.NodeCopy | None, str]:
        """Local rank 0's part: the copy from its own store when that holds it, else from the
        holders in turn by node (the next holder where one refuses it), checked, written once into
        the node's shared file; (None, "") when none gave it or there is no room to share it."""
        asked, data = self._take_prefetched(step, entry, holders)
        if not asked:
            data = next((d for d in (self._get(step, s, entry) for s in self._order(holders)) if d is not None), None)
        if data is None:
            return None, ""
        try:  # the bytes are dropped on return: the ranks read the file, no second copy held meanwhile
            return share.publish(data, [self.share_root, self.share_fallback], self._started)
        except OSError as exc:
            log.warning("peer copy of step %d of rank %d/%d not shared on node %d: %s", step, entry[1], entry[0],
                        self.comm.node, exc)
            return None, ""

    def _order(self, holders: list[str]) -> list[str]:
        """The stores this node tries for a copy: its own first when it holds the copy, then the
        others from one that depends on the node, so that nodes do not all pull from one store."""
        own = self.stores[self.comm.node]
        others = [h for h in holders if h != own]
        start = self.comm.node % len(others) if others else 0
        return [own] * (own in holders) + others[start:] + others[:start]

    @staticmethod
    def _candidates(held: list[tuple[str, list[Any]]], step: int) -> list[tuple[list[Any], list[str]]]:
        """The full copies of `step` (the latest history first), each with the stores holding it."""
        candidates: list[tuple[list[Any], list[str]]] = []
        for store, entry in sorted(((s, e) for s, e in held if e[2] == step and e[3] == "full"),
                                   key=lambda c: -int(str(c[1][6]).split("-")[0])):  # the latest history first
            found = next((c for c in candidates if c[0] == entry), None)  # the same copy in another store
            if found is None:
                candidates.append((entry, [store]))
            else:
                found[1].append(store)
        return candidates

    def prefetch(self) -> None:
        """Local rank 0 starts fetching, in the background, the copy a restore most likely takes:
        the first candidate (`_candidates`, as rank 0 orders them in `load`) of the newest full
        step the stores hold, checked as `_get` checks every copy, while the worker builds its
        model (imports and allocation, about 1.7 s here); `_publish` takes it when `load` asks
        for that copy and fetches as before otherwise. Not collective; no copy: nothing done."""
        if self.comm.local_rank == 0 and self._prefetch is None:
            self._prefetch = threading.Thread(target=self._fetch_newest, name="peer-prefetch", daemon=True)
            self._prefetch.start()

    def _fetch_newest(self) -> None:
        held = self._held()
        steps = [e[2] for _, e in held if e[3] == "full"]
        candidates = self._candidates(held, max(steps)) if steps else []
        if candidates:
            entry, holders = candidates[0]
            data = next((d for d in (self._get(entry[2], s, entry) for s in self._order(holders)
                                     if not self._prefetch_dropped) if d is not None), None)
            if not self._prefetch_dropped:  # None: every holder was asked and none gave it
                self._prefetched = (entry[2], entry, holders, data)

    def _take_prefetched(self, step: int, entry: list[Any], holders: list[str]) -> tuple[bool, bytes | None]:
        """(whether the prefetch got the copy `entry` of `step` or asked each of `holders` for it in
        vain, the checked bytes it got), waiting for the fetch to end; dropped either way: a copy
        not asked for is not held for the run, and one asked for in vain is not asked for again."""
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None
        found, self._prefetched = self._prefetched, None
        if found is None or (found[0], found[1]) != (step, entry):
            return False, None
        return found[3] is not None or set(holders) <= set(found[2]), found[3]

    def _drop_prefetched(self) -> None:
        """No restore takes the prefetched copy (a newer durable step was chosen): not waited for;
        a fetch still under way ends without keeping it and asks no further store."""
        self._prefetch_dropped, self._prefetch, self._prefetched = True, None, None

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """(training state, this rank's per-rank state or None) of `step` from the stores, else None
        on every rank alike (collective). Rank 0 lists the full copies (newest generation first)
        and the stores holding each for every rank; the ranks try them in that order together,
        each fetched once per node (_node_copy), and take the first that every rank got, so that
        no two ranks ever restore different copies; none: the durable tiers."""
        self._started = time.time()
        held = self._held(collective=True)
        candidates = self._candidates(held, step) if self.comm.rank == 0 else None
        for entry, holders in self.comm.all_gather_object(candidates)[0]:
            with self._node_copy(step, entry, holders) as model:
                (missed,) = self.comm.any_true(model is None)
            if missed:
                continue
            assert model is not None
            self.restored_world, self.restored_gen = int(entry[0]), str(entry[6])
            return model["state"], self._own(step, entry, held, model)
        return None

    def _own(self, step: int, entry: list[Any], held: list[tuple[str, list[Any]]], model: dict[str, Any]
             ) -> dict[str, Any] | None:
        """This rank's per-rank state (RNG streams) of the chosen copy's history: its own small
        copy from a store, else the chosen copy's where that copy is its own; else None (re-seeded)."""
        mine = [(s, e) for s, e in held if e[2] == step and e[3] == "rank"
                and (e[0], e[1], e[6]) == (self.comm.world, self.comm.rank, entry[6])]
        own = next((o for o in (self._fetch(step, s, e) for s, e in mine) if o is not None), None)
        if own is None and (entry[0], entry[1]) == (self.comm.world, self.comm.rank):
            own = model
        if own is None and entry[0] == self.comm.world:
            log.warning("rank %d: no store holds its own state of step %d (it was on the lost node): its random "
                        "streams are re-seeded", self.comm.rank, step)
        return own["rng"] if own is not None else None

    def keep_only(self, step: int) -> None:
        """This world restored `step` (0: none): every store forgets the copies of other steps
        (later ones are another history now, older ones are of no use) and of other world sizes'
        at that step, so that no later restore mixes them with this one's; and records the restore,
        so that a store cut off now cannot offer its copies of the history left (history.py)."""
        self._drop_prefetched()  # a prefetched copy no restore took (a newer durable step) is not held
        taken = self.restored_gen if step and self.restored_world else history.DURABLE
        self.generation = self.comm.all_gather_object(  # rank 0's: one per world, after every one listed
            history.next_generation(step, self.seen | {self.generation}, time.time()))[0]
        if self.comm.local_rank == 0:
            try:
                self.link.keep_only(self.stores[self.comm.node], self.restored_world if step else 0, step,
                                    self.generation, taken)
            except PeerRefused as exc:
                log.warning("%s", exc)
        self.comm.barrier()


def open_tier(comm: Comm) -> PeerTier | None:
    """The tier, when the entrypoint started a store on this node; else None (on every rank alike:
    the decision is combined). A world of one node (a run shrunk to it) still lists, loads and
    forgets the copies its store holds; it sends none (no buddy: `due` is never true)."""
    every = contract.recovery(contract.PEER_EVERY.name)
    store = os.environ.get(ADDR_VAR, "")
    key = os.environ.get(wire.KEY_VAR, "")
    (missing,) = comm.any_true(not (store and len(key) >= wire.MIN_KEY_CHARS))
    if missing:
        return None
    return PeerTier(comm, every, key.encode(), store, node_zone())


def choose(ckpt: CheckpointManager, comm: Comm, tier: PeerTier | None) -> Resumed | None:
    """run_control.choose_checkpoint with the peer tier first (when there is one): the newest
    step every rank can get from a peer store, its disk or the bucket, in that order; then the
    stores forget later steps (another history once this world goes on from the chosen one)."""
    if tier is not None:
        tier.share_fallback = str(ckpt.local)  # node-local scratch, not the container's root disk
    found = choose_checkpoint(ckpt, comm, **_restore_from(tier, ckpt.load))
    if tier is not None:
        tier.keep_only(found.step if found is not None else 0)
    return found


def _restore_from(tier: PeerTier | None, load: Any) -> dict[str, Any]:
    """choose_checkpoint's arguments that put the peer tier first: `extra` steps, the stores tried
    `first` (collective, once) and then `load` (the manager's: the disk and the bucket, retried
    where the bucket does not answer)."""
    if tier is None:
        return {}

    def from_peers(step: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        found = tier.load(step)  # collective: None on every rank alike, never a mix of tiers
        if found is not None:
            log.info("rank %d restores step %d from peer memory", tier.comm.rank, step)
        return found

    def load_step(step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        try:
            return load(step)  # type: ignore[no-any-return]
        except CheckpointError as exc:
            raise CheckpointError(f"no peer copy of step {step}, and {exc}") from None
    return {"extra": tier.steps(), "first": from_peers, "load": load_step}
