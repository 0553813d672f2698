"""The peer tier for sharded state (FSDP2 `fully_shard`, DTensors; issue 46): every PEER_EVERY steps
each rank's shard goes into host memory on its own node's peer store and on its buddy's (and on
PEER_HOLDERS - 1 more nodes': shardset.holders), and after a
loss the new world restores the newest step the surviving stores hold whole, resharded by DCP into
this run's world (any size).

The copy. The ranks agree that no copy is still on its way (one all-reduce; a copy still in flight
on any rank makes this one skipped on all, logged, never a wait: DCP's save is collective). Then
each rank DCP-saves its shard of the model and optimizer as training/ckpt/sharded.py does (torch's
`async_save`: the loop waits for the staging into reused host buffers only; the write runs on a
gloo group of the tier's own) into a private directory of its own (share.NodeCopy: mkdtemp, 0700,
in /dev/shm, else the checkpoint manager's local directory), beside its RNG state (and, rank 0,
the train state). A background thread waits for the write (DCP's save ends when rank 0 has written
the metadata), sends each file to its holders' stores and to its own node's (signed and digested as
every copy is: wire.py), and removes the directory.

The restore (`load`, collective, from training/ckpt/run_control.py's choose_checkpoint through
`choose`): rank 0 lists the complete sets of the step (shardset.py); for each in turn every node's
local rank 0 fetches DCP's metadata and the train state into a private directory, each rank asks
DCP's load planner which bytes of which saved shards its new shard reads, and local rank 0 fetches
those of its node's ranks (whole files, or the pieces covering those bytes; each checked against its
digest, a copy that does not match refused by name and the next holder tried); the ranks vote: the
first set every node got is used, else the disk and the bucket. Every rank DCP-loads from its node's
directory with this run's sharding (`ShardedCheckpoints.restore(folder=...)`), then it goes (`release`)."""

from __future__ import annotations

import io
import logging
import shutil
import stat
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save

from training import contract
from training.ckpt.files import CheckpointError, unpickle
from training.ckpt.manager import rng_name
from training.ckpt.peer import share, shardset, wire
from training.ckpt.peer.client import PeerRefused
from training.ckpt.peer.tier import PeerTier, start_sender
from training.ckpt.run_control import Resumed, choose_checkpoint
from training.ckpt.sharded import TRAIN_STATE, Optimizers, ShardedCheckpoints, _optimizers, leave_group

log = logging.getLogger("gts.peer")


class ShardedPeer:
    """One rank's side of the sharded peer tier, over `tier` (its stores, buddy, key and
    generation). Every rank makes one (a collective: its gloo group)."""

    name = "peer"

    def __init__(self, tier: PeerTier, model: nn.Module, optimizer: Optimizers):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.tier, self.comm = tier, tier.comm
        self.model, self.optimizer = model, optimizer
        count = contract.recovery(contract.PEER_HOLDERS.name)  # the nodes that hold this node's copies, itself aside
        self.holders = shardset.holders(self.comm.node, tier.zones, count) if tier.buddy is not None else []
        self.group = dist.new_group(backend="gloo") if self.comm.distributed else None
        cuda = self.comm.device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self._sender: threading.Thread | None = None
        self._pending: Future[Any] | None = None
        self._in_flight: share.NodeCopy | None = None  # the directory the sender reads from
        self.blocked_s, self.skipped, self.error = 0.0, 0, ""  # as PeerTier's: the loop's wait, copies left out
        self.sent: list[int] = []
        self.folder: Path | None = None  # the restored peer step's files on this node (`load`)
        self._restored: share.NodeCopy | None = None  # local rank 0: that directory, removed by `release`

    @property
    def refusals(self) -> list[str]:
        return self.tier.refusals

    def due(self, step: int) -> bool:
        return self.tier.due(step)

    def _busy(self) -> bool:
        return self._sender is not None and self._sender.is_alive()

    def copy(self, step: int, state: dict[str, Any] | None, rng: dict[str, Any], budget_s: float | None = None
             ) -> float:
        """Every rank: stage its shard and send it in the background (`state`: the train state,
        written by rank 0). `budget_s` (a stop): wait for the copy before it and this one, at most
        that long in all. Returns the seconds the loop was blocked."""
        start = time.perf_counter()
        if self.tier.buddy is None:  # a world of one node (on every rank alike): no other node to hold it
            self.skipped += 1
            return 0.0
        if self._busy() and budget_s is not None:
            assert self._sender is not None
            self._sender.join(budget_s)
        mine = self._busy()
        model_state, optim_state = ({}, {}) if mine else get_state_dict(self.model, _optimizers(self.optimizer))
        # every local rank writes its shard into the same /dev/shm at once: room for all of them
        need = 0 if mine else int(shardset.local_bytes((model_state, optim_state)) * 1.1 + 2**20) * self.comm.local_world
        node_copy, why = (None, "") if mine else self._prepare(state, rng, need)
        # DCP's save is collective: every rank copies, or none (one still sending, or one without room)
        busy, failed = self.comm.any_true(mine, not mine and node_copy is None)
        if busy or failed:
            if node_copy is not None:
                node_copy.remove()
            if busy:
                self.skipped += 1
                if self.comm.rank == 0:
                    log.info("peer copy of step %d skipped: the one before is still being sent", step)
            else:  # not made: counted as left out, never recorded as a copy the stores hold
                self.skipped += 1
                if why:
                    self.error = why
                    log.warning("peer copy of step %d not made: %s", step, why)
            return time.perf_counter() - start
        assert node_copy is not None
        # what every rank holds whole (an optimizer's step counts, its groups) goes into rank 0's file,
        # not spread over the ranks': a restore's node then needs its own ranks' shards and rank 0's (`_needed`)
        pending = async_save({"model": model_state, "optim": optim_state}, storage_writer=shardset.PeerWriter(node_copy.dir),
                             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), process_group=self.group,
                             no_dist=self.group is None, async_stager=self.stager)
        assert isinstance(pending, Future)
        self._pending = pending
        self._in_flight = node_copy
        self._sender = start_sender(self._send, (step, node_copy, pending), "peer-shard-copy", step, start, budget_s)
        blocked = time.perf_counter() - start
        self.blocked_s += blocked
        if self.comm.rank == 0:
            log.info("peer copy of step %d: loop blocked %.3f s", step, blocked)
        return blocked

    def _prepare(self, state: dict[str, Any] | None, rng: dict[str, Any], need: int
                 ) -> tuple[share.NodeCopy | None, str]:
        """(a new private directory holding this rank's RNG state and, on rank 0, the train state,
        "") or (None, why): mkdtemp, 0700, locked while this process lives (a restore's sweep
        removes one a killed worker left), in /dev/shm, else the node's scratch: the first with
        `need` bytes free (the shard DCP writes there later, in the background: a container's
        /dev/shm of 64 MiB would fail every copy while the scratch has room)."""
        failures = []
        for root in dict.fromkeys((self.tier.share_root, self.tier.share_fallback)):
            node_copy = None
            try:
                free = shutil.disk_usage(root).free if root else 0
                if root and free < need:
                    failures.append(f"{root}: {free} bytes free, {need} needed")
                    continue
                node_copy = share.NodeCopy(root) if root else None
                if node_copy is not None:
                    torch.save(rng, Path(node_copy.dir) / rng_name(self.comm.rank))
                    if self.comm.rank == 0:
                        torch.save(state, Path(node_copy.dir) / TRAIN_STATE)
                    return node_copy, ""
            except (OSError, RuntimeError) as exc:  # torch reports a full disk as its own RuntimeError
                if node_copy is not None:
                    node_copy.remove()
                failures.append(f"{root}: {getattr(exc, 'strerror', None) or exc}")
        return None, "no room for it: " + "; ".join(failures or ["no place to write it"])

    def _send(self, step: int, node_copy: share.NodeCopy, pending: Future[Any]) -> None:
        """Once DCP's write is done: each of this rank's files to its holders' stores (the buddy's
        first), then to its own node's (which keeps it through a restart of the workers), then the
        directory goes."""
        tier, rank = self.tier, self.comm.rank
        size, missed = 0, []
        try:
            pending.result()
            names = [("shard", shardset.file_name(rank, "shard")), ("rng", rng_name(rank))]
            names += [(kind, shardset.file_name(0, kind)) for kind in shardset.NEEDED_OF_RANK0] if rank == 0 else []
            stores = dict.fromkeys([*(tier.stores[n] for n in self.holders), tier.stores[self.comm.node]])
            for kind, name in names:
                data = (Path(node_copy.dir) / name).read_bytes()
                named, size = wire.payload_digest(data), size + len(data)
                for store in stores:
                    try:
                        tier.link.put(store, self.comm.world, rank, step, kind, data, named, tier.generation)
                    except Exception as exc:  # noqa: BLE001 - one store's refusal (507, gone): the others get theirs
                        missed.append(f"{kind} to {store}: {exc}")
                del data
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (DCP's write, a file: logged)
            missed.append(str(exc))
        finally:
            node_copy.remove()
        if missed:
            self.error = "; ".join(missed)
            log.warning("peer copy of step %d of rank %d not sent: %s", step, rank, self.error)
            return
        self.sent.append(step)
        if self.comm.rank == 0:
            log.info("peer copy of step %d on node %s and this node (%.1f MiB from rank 0)", step,
                     ", ".join(map(str, self.holders)), size / 2**20)

    def close(self, timeout_s: float | None = None) -> None:
        """The copy on its way: its DCP write done (the save group's collectives end before the
        group goes), its sending waited for up to `timeout_s`; then the ranks leave the group together."""
        if self._pending is not None:
            try:
                self._pending.result()
            except (Exception, CheckpointException):  # noqa: BLE001 (reported by the sender thread)
                pass
        if self._sender is not None:
            self._sender.join(timeout_s)
            if self._sender.is_alive() and self._in_flight is not None:  # a stop's budget spent: the daemon
                self._in_flight.remove()  # sender dies with the process; its shard must not stay in /dev/shm
        self.stager.close()
        leave_group(self.group)
        self.group = None

    # ------------------------------------------------------------------ recovery
    def steps(self) -> set[int]:
        """Steps whose every shard, metadata and train state some store holds (shardset.sets)."""
        return {step for step, _, _ in shardset.sets(self.tier._held())}

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """(train state, this rank's RNG state or None) of `step` from the stores, the files this
        node's ranks read in `self.folder`; else None on every rank alike (collective). Rank 0 lists
        the step's complete sets; the ranks try them in that order together (`_fetch`) and take the
        first every node got."""
        comm = self.comm
        before = time.time()
        held = self.tier._held(collective=True)
        for world, gen, files in comm.all_gather_object(shardset.candidates(held, step) if comm.rank == 0 else None)[0]:
            state, path, why = self._fetch(step, world, files, before)
            (missed,) = comm.any_true(state is None)
            if missed:
                if why:
                    log.warning("peer copy of step %d saved by %d ranks not used on node %d: %s", step, world,
                                comm.node, why)
                self.release()
                continue
            assert state is not None
            self.folder, self.tier.restored_world, self.tier.restored_gen = Path(path), world, gen
            return state, (self._own_rng(step, world, gen, held) if world == comm.world else None)
        return None

    def _fetch(self, step: int, world: int, files: shardset.Files, before: float
               ) -> tuple[dict[str, Any] | None, str, str]:
        """(train state, the node's directory, "") or (None, path, why), on every rank (collective).
        The node's local rank 0 fetches the metadata and the train state into a private directory;
        each rank asks DCP's planner which bytes of which saved shards its own shard reads in this
        run (`_needed`); local rank 0 fetches those of all its node's ranks (shardset.fetch_into),
        into /dev/shm where it has room for them, else the scratch (shardset.make_room)."""
        comm, tier = self.comm, self.tier
        why, path, head = "", "", [key for key in files if key[1] != "shard"]
        roots = [tier.share_root, tier.share_fallback]
        if comm.local_rank == 0:  # room for the head; the shards' is counted once their ranges are known
            self._restored, why = shardset.open_dir(roots, before, shardset.head_size(files))
            if self._restored is not None:
                why = shardset.fetch_into(tier, step, world, files, head, self._restored)
                path = "" if why else self._restored.dir
        first = comm.rank - comm.local_rank
        path = comm.all_gather_object(path)[first]
        state, why = self._read(path, why)
        needed, why = self._needed(path) if state is not None else ({}, why)
        wanted: dict[int, list[tuple[int, int]]] = {}  # saving rank -> the byte ranges this node's ranks read
        for ranks in comm.all_gather_object(needed)[first:first + comm.local_world]:
            for rank, ranges in ranks.items():
                wanted.setdefault(rank, []).extend(ranges)
        if comm.local_rank == 0 and self._restored is not None and not why:
            self._restored, why = shardset.make_room(self._restored, roots, before, shardset.shard_bytes(files, wanted))
            why = why or shardset.fetch_into(tier, step, world, files, [(r, "shard") for r in wanted], self._restored,
                                             wanted)
            path = "" if why else self._restored.dir  # moved where /dev/shm had no room for the shards
            log.info("peer step %d on node %d: %.1f MiB fetched of the set's %.1f MiB into %s", step, comm.node,
                     self._restored.fetched / 2**20, shardset.size(files) / 2**20, self._restored.dir)
        path = comm.all_gather_object(path)[first]
        return (state if not why else None), path, why

    def _needed(self, path: str) -> tuple[dict[int, list[tuple[int, int]]], str]:
        """({saving rank: the byte ranges (offset, length) of its shard file this rank reads}, "")
        in this run's sharding, per DCP's metadata in `path` and its own planner (what `dcp_load`
        will read); else ({}, why)."""
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        from training.ckpt.sharded import _Reader

        try:
            metadata = _Reader(path).read_metadata()
            model_state, optim_state = get_state_dict(self.model, _optimizers(self.optimizer))
            planner = DefaultLoadPlanner()
            planner.set_up_planner({"model": model_state, "optim": optim_state}, metadata, False)
            where = [metadata.storage_data[item.storage_index] for item in planner.create_local_plan().items]
        except Exception as exc:  # noqa: BLE001 (a metadata DCP cannot plan from: refused, every rank goes on to the vote)
            return {}, f"{path}: DCP's metadata cannot be planned from: {exc}"
        found: dict[int, list[tuple[int, int]]] = {}
        for info in where:
            for rank in shardset.shard_ranks({info.relative_path}):
                found.setdefault(rank, []).append((int(info.offset), int(info.length)))
        return found, ""

    def _read(self, path: str, why: str) -> tuple[dict[str, Any] | None, str]:
        """The train state in the node's directory when that is this user's private one; else (None, why)."""
        if not path:
            return None, why
        try:
            if not share._private(Path(path).lstat(), stat.S_IFDIR):
                return None, f"{path} is not this user's private directory: refused"
            return unpickle(Path(path) / TRAIN_STATE), ""
        except (OSError, CheckpointError) as exc:
            return None, f"{path}/{TRAIN_STATE}: {exc}"

    def _own_rng(self, step: int, world: int, gen: str, held: list[tuple[str, list[Any]]]) -> dict[str, Any] | None:
        """This rank's RNG state of the set, from a store whose copy matches its digest; else None
        (its streams are re-seeded, logged)."""
        pairs = [(s, e) for s, e in held if e[2] == step and e[3] == "rng" and (e[0], e[1], e[6]) ==
                 (world, self.comm.rank, gen)]
        data = shardset.fetch_one(self.tier, step, pairs) if pairs else None
        if data is not None:
            try:
                return dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
            except Exception as exc:  # noqa: BLE001 (the sender's own bytes, not loadable: re-seeded)
                log.warning("rank %d: its RNG state of step %d cannot be loaded: %s", self.comm.rank, step, exc)
        log.warning("rank %d: no store holds its own RNG state of step %d: its random streams are re-seeded",
                    self.comm.rank, step)
        return None

    def forget(self) -> None:
        """This node's store drops every copy (local rank 0; no collective: a failed load may have
        left the ranks apart), so that the restart restores from the disk or the bucket."""
        if self.comm.local_rank == 0:
            try:
                self.tier.link.keep_only(self.tier.stores[self.comm.node], 0, 0)
                log.warning("the peer copy of this world's step could not be loaded: node %d's store forgot its "
                            "copies; the restart goes to the disk or the bucket", self.comm.node)
            except PeerRefused as exc:
                log.warning("%s", exc)

    def release(self) -> None:
        """The restored step's directory removed, once every rank has read what it needs (collective)."""
        self.comm.barrier()
        if self._restored is not None:
            self._restored.remove()
            self._restored = None
        self.folder = None


def open_sharded(tier: PeerTier | ShardedPeer | None, model: nn.Module, optimizer: Optimizers) -> ShardedPeer | None:
    """The sharded tier over `tier`'s stores (None where there is no store: on every rank alike)."""
    return ShardedPeer(tier, model, optimizer) if isinstance(tier, PeerTier) else tier


def choose(sharded: ShardedCheckpoints, peer: PeerTier | ShardedPeer | None) -> Resumed | None:
    """The newest step every rank can get: from the peer stores (a complete set), else the disk,
    else the bucket (ShardedCheckpoints.verify); never a mix of tiers for one step. The stores
    then keep the restored step alone (PeerTier.keep_only). A peer step's files are in
    `peer.folder` until `restore` has loaded them."""
    if not isinstance(peer, ShardedPeer):
        return sharded.choose()
    sharded.wait()
    peer.tier.share_fallback = str(sharded.manager.local)  # node-local scratch, not the container's root disk

    def from_peers(step: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        found = peer.load(step)  # collective: None on every rank alike; never inside the bucket's retries
        if found is not None and peer.comm.rank == 0:
            log.info("restoring sharded step %d from peer memory (saved by %d ranks)", step, peer.tier.restored_world)
        return found

    def load(step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        try:
            return sharded.verify(step)
        except CheckpointError as exc:
            raise CheckpointError(f"no peer copy of step {step}, and {exc}") from None
    found = choose_checkpoint(sharded.manager, sharded.comm, load, peer.steps(), first=from_peers)
    peer.tier.keep_only(found.step if found is not None else 0)
    return found


def restore(sharded: ShardedCheckpoints, peer: PeerTier | ShardedPeer | None, step: int, model: nn.Module,
            optimizer: Optimizers, saved_world: int, load: bool = True) -> None:
    """`step`'s shards into this run's sharding (collective), from the peer copy `choose` fetched when
    it did, else from the disk; then the peer copy's directory goes (also with `load` False: a run
    that does not go on from the step)."""
    from training.ckpt.sharded import full_params_sha256

    shared = peer if isinstance(peer, ShardedPeer) else None
    try:
        if load:
            sharded.restore(step, model, optimizer, shared.folder if shared is not None else None)
    except BaseException:
        if shared is not None and shared.folder is not None:  # a set the ranks chose that DCP cannot load:
            shared.forget()  # the restart must not choose it again; the disk or the bucket then
        raise
    finally:
        if shared is not None:
            shared.release()
    if load:
        digest = full_params_sha256(model)
        if sharded.comm.rank == 0:
            log.info("restored step %d saved by %d ranks into %d: params_sha256=%s", step, saved_world,
                     sharded.comm.world, digest)
