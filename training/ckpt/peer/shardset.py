"""Which sharded steps the peer stores hold whole, and one node's fetch of such a step (issue 46;
training/ckpt/peer/sharded.py uses them).

A sharded step saved by a world of W ranks is in the stores as copies of four kinds (wire.COPY):
`shard` (rank r's DCP file, every r < W), `meta` (DCP's metadata, from rank 0), `train` (the
train state beside the shards, from rank 0) and `rng` (each rank's streams). Each rank sends its
own to its node's store and to its buddy's, so a step stays whole when any one node is lost
(the lost node's on its buddy, its predecessor's in the predecessor's own store); with
PEER_HOLDERS=h to h other nodes (holders()), so that it stays whole when any h nodes are. A step is
*complete* for (W, generation) when every `shard` of r < W, the `meta` and the `train` copy are
in some store; `rng` copies are not needed (a rank without its own is re-seeded, as the durable
path does when the world size changed). Copies of two histories (generations) are never mixed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from training.ckpt.peer import share, wire
from training.ckpt.peer.client import PeerRefused
from training.ckpt.peer.ring import buddy
from training.ckpt.peer.tier import PeerTier
from training.ckpt.sharded import METADATA, TRAIN_STATE, _Writer

log = logging.getLogger("gts.peer")
NEEDED_OF_RANK0 = ("meta", "train")
SHARD_FILE = re.compile(r"^__(\d+)_0\.distcp$")

# (rank, kind) -> [(store, entry)], entry as the stores list it: [world, rank, step, kind, digest, size, generation]
Files = dict[tuple[int, str], list[tuple[str, list[Any]]]]


class PeerWriter(_Writer):
    """DCP's file writer for a peer copy: no fsync (the copy lives in memory, /dev/shm, for
    seconds), and each file's items smallest first. What every rank reads of rank 0's file (the
    values held whole, as the optimizer's step counts, which DCP writes into the lowest rank's
    file only) then sits in its first pieces rather than between every parameter's moments, so
    that a node of other ranks fetches those pieces of it, not all (fetch_into)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        return super().write_data(dataclasses.replace(plan, items=sorted(plan.items, key=_item_bytes)), planner)


def _item_bytes(item: WriteItem) -> int:
    """A write item's bytes (a pickled value, BYTE_IO: 0, first)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def holders(node: int, zones: list[str], count: int) -> list[int]:
    """The other nodes that hold node `node`'s sharded copies (PEER_HOLDERS of them, at most every
    other node), its buddy first (tier.buddy: another zone when the run spans zones). The rest go
    round buddy()'s ring: where no zone holds more than half the nodes, the nodes in zone order,
    each holder one place further on than the last (every shift a permutation, so each node holds
    as many nodes' copies as it sends); else the nodes in order. With the node's own store, a step
    survives any `count` lost nodes."""
    total = len(zones)
    want = min(count, total - 1)
    if want < 1:
        return []
    largest = max(zones.count(z) for z in set(zones))
    spread = len(set(zones)) > 1 and 2 * largest <= total  # buddy()'s dealing by ring
    ring = sorted(range(total), key=lambda n: (zones[n], n)) if spread else list(range(total))
    start, at = (largest if spread else 1), ring.index(node)
    chosen = [buddy(node, zones)]
    for shift in range(start, start + total):
        candidate = ring[(at + shift) % total]
        if len(chosen) < want and candidate != node and candidate not in chosen:
            chosen.append(candidate)
    return chosen


def file_name(rank: int, kind: str) -> str:
    """The name DCP (and training/ckpt/sharded.py) gives the file a copy holds."""
    return {"shard": f"__{rank}_0.distcp", "meta": METADATA, "train": TRAIN_STATE}[kind]


def complete(files: Files, world: int) -> bool:
    return all((r, "shard") in files for r in range(world)) and all((0, k) in files for k in NEEDED_OF_RANK0)


def sets(held: list[tuple[str, list[Any]]], step: int | None = None) -> dict[tuple[int, int, str], Files]:
    """(step, world, generation) -> its files, for the sharded copies in `held` (of `step` only, when
    given), complete ones only."""
    found: dict[tuple[int, int, str], Files] = {}
    for store, entry in held:
        world, rank, at, kind, _, _, gen = entry
        if kind in ("shard", "meta", "train") and (step is None or at == step):
            found.setdefault((int(at), int(world), str(gen)), {}).setdefault((int(rank), kind), []).append((store, entry))
    return {key: files for key, files in found.items() if complete(files, key[1])}


def candidates(held: list[tuple[str, list[Any]]], step: int) -> list[tuple[int, str, Files]]:
    """(world, generation, files) of every complete set of `step`, the latest history first (the
    generation's leading number: when the world that sent it restored), then the larger world."""
    found = [(world, gen, files) for (_, world, gen), files in sets(held, step).items()]
    return sorted(found, key=lambda c: (-int(c[1].split("-")[0]), -c[0]))


def fetch_one(tier: PeerTier, step: int, pairs: list[tuple[str, list[Any]]]) -> bytes | None:
    """The bytes of one file from the first store (in this node's order, tier._order) whose copy
    matches its digest; a copy that does not is refused by name (tier._get) and the next holder
    tried. None when no holder gave a good copy."""
    by_store = {store: entry for store, entry in pairs}
    for store in tier._order(list(by_store)):
        data = tier._get(step, store, by_store[store])
        if data is not None:
            return data
    return None


def open_dir(roots: list[str], before: float, size: int) -> tuple[share.NodeCopy | None, str]:
    """A node's local rank 0: a private directory for this restore (share.NodeCopy: mkdtemp, 0700)
    in the first of `roots` with `size` bytes free (a container's /dev/shm may be small), after
    sweeping what dead publishers left there (share.sweep); else (None, why)."""
    where = [r for r in dict.fromkeys(roots) if r]
    failures = []
    for root in where:
        share.sweep(root, before)
        try:
            st = os.statvfs(root)
            if st.f_bavail * st.f_frsize < size:
                failures.append(f"{root}: {st.f_bavail * st.f_frsize} bytes free, {size} needed")
                continue
            return share.NodeCopy(root), ""
        except OSError as exc:
            failures.append(f"{root}: {exc.strerror or exc}")
    return None, "no room to share it: " + "; ".join(failures or ["no place to write it"])


def size(files: Files) -> int:
    """The bytes of a set's files as the stores list them (the largest listing of each)."""
    return sum(max(int(entry[5]) for _, entry in pairs) for pairs in files.values())


def head_size(files: Files) -> int:
    """The bytes of a set's metadata and train state (the files every node fetches whole)."""
    return size({key: pairs for key, pairs in files.items() if key[1] != "shard"})


def shard_bytes(files: Files, wanted: dict[int, list[tuple[int, int]]]) -> int:
    """The bytes fetch_into writes for the shards `wanted` (saving rank -> byte ranges its node's
    ranks read): the pieces that cover them (what is not written is a hole, which takes no room)."""
    total = 0
    for rank, ranges in wanted.items():
        whole = max((int(entry[5]) for _, entry in files.get((rank, "shard"), [])), default=0)
        total += min(whole, sum(count for _, count in piece_runs(ranges, whole)) * wire.PIECE)
    return total


def make_room(node_copy: share.NodeCopy, roots: list[str], before: float, need: int) -> tuple[share.NodeCopy, str]:
    """`node_copy` when its file system has `need` bytes more free (the shards this node reads);
    else a directory in the first other of `roots` with room for those and what `node_copy` holds
    (the metadata and train state, moved there; `node_copy` removed); else (node_copy, why)."""
    moved = None
    try:  # a disk error here is a reason like any other: every rank then goes to the disk or the bucket
        here = os.statvfs(node_copy.dir)
        if here.f_bavail * here.f_frsize >= need:
            return node_copy, ""
        held = {name: Path(node_copy.dir, name).read_bytes() for name in os.listdir(node_copy.dir)}
        here_root = os.path.realpath(os.path.dirname(node_copy.dir))
        others = [r for r in roots if r and os.path.realpath(r) != here_root]
        moved, why = open_dir(others, before, need + sum(len(data) for data in held.values()))
        if moved is None:
            return node_copy, f"no room for the {need} bytes of shards this node's ranks read: {why}"
        for name, data in held.items():
            moved.write(data, name)
    except OSError as exc:
        if moved is not None:
            moved.remove()
        return node_copy, f"{exc.filename or node_copy.dir}: {exc.strerror or exc}"
    moved.fetched = node_copy.fetched
    node_copy.remove()
    return moved, ""


def fetch_into(tier: PeerTier, step: int, world: int, files: Files, keys: list[tuple[int, str]],
               node_copy: share.NodeCopy, ranges: dict[int, list[tuple[int, int]]] | None = None) -> str:
    """The files `keys` of the set, fetched one at a time (one file's bytes held at once), each
    written once into `node_copy` (O_EXCL, 0600): whole, or for a shard with byte `ranges` (offset,
    length: what this node's ranks read) the pieces that cover them; "" or why not (a file that
    matched in no store: the step is then not used from peers; no room)."""
    for rank, kind in sorted(keys):
        if (rank, kind) not in files:  # DCP's metadata names a shard the set does not hold
            return f"the {kind} copy of rank {rank}/{world} of step {step} is in no store's set"
        pairs, name = files[(rank, kind)], file_name(rank, kind)
        total = max(int(entry[5]) for _, entry in pairs)
        runs = piece_runs((ranges or {}).get(rank, []), total) if kind == "shard" and ranges is not None else None
        whole = runs is None or sum(count for _, count in runs) == -(-total // wire.PIECE)
        data = fetch_one(tier, step, pairs) if whole else fetch_pieces(tier, step, pairs, runs or [], total)
        if data is None:
            return f"no store gave a good {kind} copy of rank {rank}/{world} of step {step}"
        try:
            if isinstance(data, list):
                node_copy.write_parts(data, name, total)
            else:
                node_copy.write(data, name)
        except OSError as exc:
            return f"{node_copy.dir}: {exc.strerror or exc}"
        del data
    return ""


def piece_runs(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """(first piece, count) runs of the wire.PIECE-byte pieces of a file of `size` bytes that
    cover the byte ranges (offset, length)."""
    pieces = sorted({p for offset, length in ranges if length > 0 and 0 <= offset < size
                     for p in range(offset // wire.PIECE, (min(offset + length, size) - 1) // wire.PIECE + 1)})
    runs: list[tuple[int, int]] = []
    for piece in pieces:
        if runs and runs[-1][0] + runs[-1][1] == piece:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((piece, 1))
    return runs


def fetch_pieces(tier: PeerTier, step: int, pairs: list[tuple[str, list[Any]]], runs: list[tuple[int, int]],
                 size: int) -> list[tuple[int, memoryview]] | None:
    """[(offset, bytes)] of the pieces `runs` of one file of `size` bytes, all from the first store
    (this node's order) whose pieces match the copy's digest; a store whose do not is refused by
    name, one that lists another size skipped, and the next holder tried. None when no holder gave
    them all."""
    by_store = {store: entry for store, entry in pairs}
    for store in tier._order(list(by_store)):
        entry, parts = by_store[store], []
        if int(entry[5]) != size:
            log.warning("peer store %s lists %s bytes for rank %s's %s copy of step %d, another %d: skipped", store,
                        entry[5], entry[1], entry[3], step, size)
            continue
        for first, count in runs:
            try:
                data = tier.link.pieces(store, entry, step, first, count)
            except PeerRefused as exc:
                log.warning("%s", exc)
                break
            if data is None:
                world, rank, _, kind = entry[:4]
                tier._refuse(f"peer copy of step {step} of rank {rank}/{world} ({kind}) held by {store} does not match "
                             "its digest: refused")
                break
            parts.append((first * wire.PIECE, data))
        else:
            return parts
    return None


def shard_ranks(names: set[str]) -> set[int]:
    """The saving ranks of DCP files named as file_name names them (`__3_0.distcp` -> 3)."""
    return {int(match.group(1)) for name in names if (match := SHARD_FILE.match(name))}


def local_bytes(obj: Any) -> int:
    """The bytes of the tensors in `obj` this rank holds (a DTensor's local shard only)."""
    if isinstance(obj, DTensor):
        local = obj.to_local()
        return local.numel() * local.element_size()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(local_bytes(v) for v in obj)
    return 0
