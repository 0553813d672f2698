"""Sharded training state (FSDP2 `fully_shard`, or any DTensor state) through our checkpoint
manager: every rank writes its own shard with torch's distributed checkpoint (DCP), and the
step is committed, verified, uploaded and kept exactly as replicated state is
(training/ckpt/manager.py).

    ckpt = ShardedCheckpoints(manager, comm)
    blocked = ckpt.save(step, model, optimizer, train_state, rng_state())   # every rank
    found = ckpt.choose()                       # the newest step every rank verified, or None
    ckpt.restore(found.step, model, optimizer)  # DCP reshards N saved ranks into this run's M

One step's folder, on each node's disk and in the bucket:

    step-00000040/__3_0.distcp          rank 3's shard of the model and optimizer (DCP's name)
    step-00000040/dcp.metadata          DCP's global plan: which shard holds which piece (rank 0)
    step-00000040/train-state.pt        step, epoch, data position, LR schedule, config (rank 0)
    step-00000040/rng-rank00003.pt      one per rank, as for replicated state
    step-00000040/manifest-node001.json size and sha256 of what node 1's ranks wrote

Commit: the ranks write into `step-N.tmp/`; DCP's save ends with a gather of every rank's write
results to rank 0 (which then writes the metadata) and a broadcast back, so when a rank's save
has returned every rank's shard is on disk; each node's local rank 0 then hashes its node's
files, writes its manifest and renames the folder. In the background (the default) DCP's
`async_save` stages the state to host memory while the loop waits and writes it from a thread
on a gloo group of its own (it deadlocks when it shares the default group); our writer thread
waits for it and commits. Nothing in the background uses the training loop's process group.

Resharding: DCP stores each tensor as pieces with their global offsets. `restore` asks this
run's model and optimizer for their (sharded) state, so every rank reads just the pieces that
overlap its own shard, whatever the world size that saved them. The shards of other nodes are
fetched from the bucket (each file checked against its node's manifest) before any rank loads.

Verification stays per file: `choose` checks every file of every node on every rank and the
ranks compare verdicts, so one bad byte in any shard makes the step unusable for all of them
and the previous step is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import shutil
import time
from concurrent.futures import Future
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save, save as dcp_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from training.ckpt.files import unpickle
from training.ckpt import restore
from training.ckpt.manager import CheckpointError, CheckpointManager, rng_name, step_dir
from training.ckpt.run_control import Resumed, choose_checkpoint
from training.distributed import Comm

holds_dtensors = restore.holds_dtensors  # its home was here: old imports name it from this module

log = logging.getLogger("gts.sharded")
METADATA = "dcp.metadata"  # DCP's `.metadata`, renamed: a manifest lists plain, visible names only
TRAIN_STATE = "train-state.pt"
# One optimizer, several, or none (a model alone): what torch's get_state_dict takes.
Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def _optimizers(optimizer: Optimizers) -> Sequence[torch.optim.Optimizer]:
    if optimizer is None:
        return ()
    return (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else tuple(optimizer)


class _Writer(FileSystemWriter):
    def _get_metadata_path(self, rank: int | None = None) -> os.PathLike[str]:
        return Path(self.path) / METADATA


# What DCP's metadata pickle names (recorded from torch 2.13's saves): its own classes, a torch
# dtype, Size and layout, the checkpoint id's path. Nothing else is loaded from it.
_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "TensorProperties",
    "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}
SHARD_FILE_NAME = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{METADATA} names {module}.{name}, which DCP's metadata never holds: refused")


class _Reader(FileSystemReader):
    def _get_metadata_path(self, rank: int | None = None) -> os.PathLike[str]:
        return Path(self.path) / METADATA

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, a pickle, read with its own classes only (torch's reader unpickles
        anything: whoever can write a step's folder in the bucket, or holds the run's key for a
        peer copy, could run code on every rank), and every file it names a shard file of this
        folder (no path that leaves it)."""
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{METADATA} is not DCP's metadata: refused")
        names = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
        if any(not SHARD_FILE_NAME.fullmatch(n) for n in names):
            raise CheckpointError(f"{METADATA} names files that are not this folder's shards "
                                  f"({sorted(n for n in names if not SHARD_FILE_NAME.fullmatch(n))[:3]}): refused")
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


def shard(model: nn.Module, units: list[nn.Module], comm: Comm) -> nn.Module:
    """FSDP2 over all ranks: each of `units` (a transformer's blocks) is its own shard group,
    then the rest of the model. On one process the model is left as it is."""
    if not comm.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(comm.device.type, (comm.world,))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params_sha256(model: nn.Module) -> str:
    """sha256 of the full (gathered) parameters, the same for any sharding of the same values.
    Every rank must call it (it gathers); rank 0 gets the hash, the others ''."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state_sha256({k: v for k, v in full.items() if isinstance(v, torch.Tensor)}) if not dist.is_initialized() or dist.get_rank() == 0 else ""


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def read_full_model(folder: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full model state of a step's folder in one process (no process group): `template`
    is an unsharded model's state_dict, filled in place. For tests and offline inspection."""
    state: dict[str, Any] = {"model": {k: v.clone() for k, v in template.items()}}
    dcp_load(state, storage_reader=_Reader(folder), no_dist=True)
    model: dict[str, torch.Tensor] = state["model"]
    return model


class ShardedCheckpoints:
    """save / choose / restore of sharded state through `manager`. Every rank makes one."""

    def __init__(self, manager: CheckpointManager, comm: Comm, background: bool = True):
        self.manager, self.comm, self.background = manager, comm, background
        # DCP's collectives, in the background included, on a gloo group of their own.
        self.group = dist.new_group(backend="gloo") if comm.distributed else None
        self.pending: Future[Any] | None = None
        # One stager for the run: its host buffers are reused from one checkpoint to the next
        # (pinned on GPUs, so the copy the loop waits for is a DMA).
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = comm.device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))

    def wait(self) -> None:
        """Until this rank's previous save is written (and, on a node's local rank 0, committed)."""
        if self.pending is not None:
            try:
                self.pending.result()
            except (Exception, CheckpointException):  # noqa: BLE001 (reported by the writer thread on local rank 0)
                pass
            self.pending = None
        self.manager.wait_commit()

    def save(self, step: int, model: nn.Module, optimizer: Optimizers, train_state: dict[str, Any],
             rng: dict[str, Any]) -> float:
        """Checkpoint `step`: every rank's shard, rank 0's `train_state` (plain values), each
        rank's RNG state. Returns the seconds the caller was blocked. Every rank calls it."""
        start = time.perf_counter()
        manager, topo = self.manager, self.manager.topo
        tmp, final = manager.local / f"{step_dir(step)}.tmp", manager.local / step_dir(step)
        self.wait()
        if topo.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.comm.barrier()
        # Small files, written without fsync here: the commit fsyncs every file before its manifest.
        torch.save(rng, tmp / rng_name(topo.rank))
        if topo.rank == 0:
            torch.save(train_state, tmp / TRAIN_STATE)
        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
        state = {"model": model_state, "optim": optim_state}
        writer = _Writer(tmp)
        if not self.background:
            dcp_save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
            if topo.local_rank == 0:
                manager.start_writer(step, lambda: self._commit(step, tmp, final, None), wait=True)
            self.comm.barrier()
            return time.perf_counter() - start
        pending = async_save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None,
                             async_stager=self.stager)
        assert isinstance(pending, Future)
        self.pending = pending
        if topo.local_rank == 0:
            manager.start_writer(step, lambda: self._commit(step, tmp, final, pending))
        return time.perf_counter() - start

    def _commit(self, step: int, tmp: Path, final: Path, pending: Future[Any] | None) -> None:
        """On a node's local rank 0, once every rank's shard is written: manifest, rename."""
        if pending is not None:
            pending.result()  # raises what the write raised: the step is not committed
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        self.manager.commit_step(step, tmp, final)  # every rank's files of this node fsync'd, then the manifest

    # ------------------------------------------------------------------ load
    def verify(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(train state, this rank's RNG state or None at another world size) of `step`, after
        every file of every node was checked here (fetched from the bucket where missing or bad)."""
        folder = self.manager.load_folder(step)
        state = unpickle(folder / TRAIN_STATE)
        if int(state.get("world_size", -1)) != self.comm.world:
            return state, None
        rng_file = folder / rng_name(self.comm.rank)
        if not rng_file.exists():
            raise CheckpointError(f"{rng_file.name} is missing")
        return state, unpickle(rng_file)

    def choose(self) -> Resumed | None:
        """The newest step that every rank verified (the ranks compare verdicts), or None."""
        self.wait()
        return choose_checkpoint(self.manager, self.comm, self.verify)

    def restore(self, step: int, model: nn.Module, optimizer: Optimizers, folder: Path | None = None) -> None:
        """Load `step`'s shards into this run's sharding (any world size). Every rank calls it,
        after `choose` agreed on the step. `folder`: where the step's files are when not on this
        node's disk (a peer copy: training/ckpt/peer/sharded.py)."""
        folder = folder or self.manager.local / step_dir(step)
        optimizers = _optimizers(optimizer)
        model_state, optim_state = get_state_dict(model, optimizers)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp_load(state, storage_reader=_Reader(folder), process_group=self.group, no_dist=self.group is None)
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def close(self) -> None:
        """This rank's last shard written; then the ranks leave the save group together and it is
        torn down before the process exits (a rank that exits while a peer still talks on it
        makes the peer abort: gloo's "terminate called", seen once in a full run)."""
        self.wait()
        self.stager.close()
        leave_group(self.group)
        self.group = None


def leave_group(group: Any) -> None:
    """The ranks leave a save group of their own together, and it is torn down; a peer already
    gone (a lost node) is no error here."""
    if group is not None and dist.is_initialized():
        try:
            dist.barrier(group=group)
        except RuntimeError:
            pass
        dist.destroy_process_group(group)

