"""Checkpoints that survive spot reclaims: written locally first, committed atomically, then
uploaded in the background to object storage.

Layout, locally and in the bucket:

    <root>/step-00000040/model.pt            model, optimizer, scaler, LR schedule, step, epoch,
                                             sampler offset (written by each node's local rank 0)
    <root>/step-00000040/rng-rank00003.pt    one per rank: python, numpy, torch and CUDA RNG
    <root>/step-00000040/manifest-node000.json   sizes and digests of this node's files; written
                                             last, it is the commit: a step without it does not exist

Locally the files are written into `step-N.tmp/` and renamed to `step-N/` once the manifest is
in: a crash leaves only a `.tmp` directory, which is never read and is removed on the next start.
Only global rank 0 uploads `model.pt`; each node uploads its ranks' RNG files and its manifest,
manifest last. A step is resumable from the bucket when the manifests of all its nodes are there.
The newest K steps are kept locally and in the bucket; a step not yet uploaded is never deleted
locally. Uploads that fail are retried with backoff and again on every later checkpoint and at
start-up, so an outage of the store never stops training and nothing committed is lost.

Before a step is loaded, every file it needs is checked against its manifest (size, BLAKE3) and unpickled
with weights_only; a failing step is skipped, saying why: fetched again from the bucket, else the step before.

With a bucket, the local folder is `<checkpoint dir>/<run key>/`, the run key derived from the
checkpoint URL: two runs never share a cache. A lock file in it stops a second trainer on the
same run (the message names the holder).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from training.ckpt import digest, fetch_process
from training.ckpt.files import (DOT_LEAF, FILE_NAME, MAX_DEPTH, MAX_NODES, MODEL_FILE, STEP_RE, CheckpointError,
                                 RunLocked, Topology, UploadStatus, check_manifest, fsync_dir, fsync_path, inside,
                                 link_or_copy, manifest_name, plain_path, rng_name, run_key, sha256_of, state_bytes,
                                 step_dir, tree_files, write_failure)
from training.ckpt.loader import BucketTier, DiskTier, Loader
from training.ckpt.tiers import Tier
from training.ckpt.uploader import Uploader
from training.ckpt.lease import Lease, take
from training.ckpt.staging import Staged, Stager, save_hashed
from training.ckpt.storage import Location, location

log = logging.getLogger("gts.checkpoint")

# What users and the rest of training/ import from here (defined in the modules above).
__all__ = ["DOT_LEAF", "FILE_NAME", "MAX_DEPTH", "MAX_NODES", "MODEL_FILE", "STEP_RE", "CheckpointError",
           "CheckpointManager", "RunLocked", "Topology", "UploadStatus", "check_manifest", "inside", "manifest_name",
           "plain_path", "rng_name", "run_key", "sha256_of", "step_dir", "tree_files"]


def _save(obj: Any, path: Path) -> None:
    """torch.save to `path` through `path.part`, not fsync'd: the commit fsyncs it (_commit)."""
    tmp = path.with_suffix(path.suffix + ".part")
    with tmp.open("wb") as fh:
        torch.save(obj, fh)
    os.replace(tmp, path)



def _lock(folder: Path) -> Any:
    """Hold `folder/.lock` for this process's life (flock: released by the kernel when it dies)."""
    handle = (folder / ".lock").open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RunLocked(f"{folder} is in use by {holder}: another trainer is on this run. Stop it, or give this "
                        "one another --checkpoint-dir / checkpoint URL") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
    handle.flush()
    return handle



class WriterSlot:
    """The one checkpoint written in the background at a time (the manager's writer thread). The
    loader and the uploader wait for it through this slot, not through the manager, so that none of
    the manager's parts holds the manager: dropping it releases its run lock at once, also while an
    upload or a prefetch of its Uploader or Loader is still running (call close() first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self.exempt: threading.Thread | None = None  # the upload thread: it only lists steps, never waits

    def start(self, writer: threading.Thread) -> None:
        with self._lock:
            self._writer = writer
        try:
            writer.start()
        except BaseException:  # no thread ("can't start new thread"): nothing for a later wait to join
            with self._lock:
                self._writer = None if self._writer is writer else self._writer
            raise

    @property
    def busy(self) -> bool:
        with self._lock:
            writer = self._writer
        return writer is not None and writer.is_alive()

    def wait(self) -> None:
        """Until the checkpoint being written is committed (or failed). The writer and the upload
        thread never wait for it (the writer is what they would wait for)."""
        with self._lock:
            writer = self._writer
        if writer is None or threading.current_thread() in (writer, self.exempt):
            return
        writer.join()
        with self._lock:
            if self._writer is writer:  # a newer writer may have started meanwhile: keep it
                self._writer = None


class CheckpointManager:
    """save / load / close. One per process; collectives stay in the caller. It holds a Loader
    (finding and loading steps: training/ckpt/loader.py), an Uploader (uploads and keep-K:
    training/ckpt/uploader.py) and the WriterSlot both wait on, and writes and commits steps itself."""

    def __init__(self, local_dir: str, remote_url: str | None, topo: Topology, keep: int = 3,
                 upload_attempts: int = 4, on_status: Callable[[UploadStatus], None] | None = None,
                 background: bool = True, for_device: bool = False):
        self.local = Path(local_dir) / run_key(remote_url) if remote_url else Path(local_dir)
        self.remote: Location | None = location(remote_url) if remote_url else None
        self.topo = topo
        self.for_device = for_device  # loads map the model file (training/ckpt/files.py's unpickle)
        self.writes = WriterSlot()
        self.loader = Loader(self.local, self.remote, topo, for_device, self.writes.wait)
        self.uploads = Uploader(self.loader, keep, upload_attempts, on_status)
        # Where a step can come from, nearest first (training/ckpt/tiers.py; a run's peer tier goes before them).
        self.tiers: tuple[Tier, ...] = (DiskTier(self.loader),) + ((BucketTier(self.loader),) if self.remote else ())
        self.local.mkdir(parents=True, exist_ok=True)
        self._held = _lock(self.local) if topo.local_rank == 0 else None
        if topo.local_rank == 0:
            for stale in self.local.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)  # a crash mid-write: never committed
        self.background = background  # False: the caller waits for the write and the commit (make bench compares)
        self._stager = Stager()
        # One run per checkpoint prefix (training/ckpt/lease.py): global rank 0 holds the bucket's lease (a fetch
        # process `prefetch` started may have taken it for this process: fetch_process.lease_answer).
        self.lease: Lease | None = take(self.remote, self._lease_lost, handed=fetch_process.lease_answer(
            self.remote.url)) if self.remote and topo.rank == 0 else None
        if self.remote is not None and topo.local_rank == 0:
            self.uploads.start()
            self.writes.exempt = self.uploads.thread
        self.loader.prefetch(early_only=True)  # a fetch started before torch (fetch_process.prefetch): taken now

    # ------------------------------------------------------------------ what the collaborators hold
    @property
    def status(self) -> UploadStatus:
        return self.uploads.status

    # The manager's former plain attributes, read and set where they now live.
    keep = property(lambda self: self.uploads.keep, lambda self, v: setattr(self.uploads, "keep", v))
    attempts = property(lambda self: self.uploads.attempts, lambda self, v: setattr(self.uploads, "attempts", v))
    on_status = property(lambda self: self.uploads.on_status, lambda self, v: setattr(self.uploads, "on_status", v))
    remote_error = property(lambda self: self.loader.remote_error,  # why the bucket's last listing failed, if it did
                            lambda self, v: setattr(self.loader, "remote_error", v))

    def local_steps(self) -> list[int]:
        return self.loader.local_steps()

    def remote_steps(self) -> list[int]:
        return self.loader.remote_steps()

    def loadable_steps(self) -> set[int]:
        return self.loader.loadable_steps()

    def prefetch(self) -> None:
        self.loader.prefetch()

    def end_prefetch(self) -> None:
        self.loader.end_prefetch()

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self.loader.load(step)

    def load_folder(self, step: int) -> Path:
        return self.loader.load_folder(step)

    def resync(self) -> None:
        self.uploads.resync()

    def wait_uploads(self, timeout: float) -> bool:
        """Block until the step being written is committed and the upload queue drained (True), or
        `timeout` passes (False)."""
        self.wait_commit()
        return self.uploads.wait_uploads(timeout)

    def _lease_lost(self, why: str) -> None:
        """Another run took the prefix: the loop stops as for a refused upload (manager.refused)."""
        with self.uploads.lock:
            self.status.permanent_error = why

    # ------------------------------------------------------------------ save
    def save(self, step: int, model_state: dict[str, Any] | None, rng_state: dict[str, Any],
             barrier: Callable[[], None]) -> float:
        """Checkpoint step `step`: every rank writes its RNG state (small); local rank 0 copies the
        model state into reused buffers and returns, while a background thread serialises it
        (hashing as it writes), fsyncs, commits the manifest, prunes and queues the upload. Pass
        None as the model state on the other ranks. One checkpoint is in flight at a time (the
        next save, and close, wait for it). Returns the seconds the caller was blocked. Every
        rank must call it (it runs `barrier` around the per-rank files)."""
        start = time.perf_counter()
        tmp = self.local / f"{step_dir(step)}.tmp"
        final = self.local / step_dir(step)
        if self.topo.local_rank == 0:
            self.wait_commit()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        try:  # fsync'd by the node's commit (_commit), on the background writer: off the loop's wait
            _save(rng_state, tmp / rng_name(self.topo.rank))
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as its own RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {step_dir(step)} could not be written: "
                                  f"{write_failure(exc, self.local, state_bytes(rng_state))}") from None
        barrier()
        if self.topo.local_rank == 0:
            assert model_state is not None
            if final.exists() and not self.loader.local_manifests(step):
                shutil.rmtree(final)  # a damaged copy (its manifest unreadable): written again
            if final.exists():  # committed before (the caller normally skips this)
                shutil.rmtree(tmp, ignore_errors=True)
            elif not self.background:
                _save(model_state, tmp / MODEL_FILE)
                self._commit(step, tmp, final)
                self.uploads.prune_local()
                self.uploads.queue_upload(step)
            else:
                staged, copies = self._stager.plan(model_state)
                copying = Staged(staged, copying=True)  # the writer starts on each storage once it is copied
                # Not a daemon: an exiting process waits for the checkpoint it already reported.
                writer = threading.Thread(target=self._write_and_commit, args=(step, staged, tmp, final, copying),
                                          name="checkpoint-write", daemon=False)
                try:
                    self.writes.start(writer)
                    self._stager.fill(copies, copying)
                except BaseException as exc:  # an interrupt before the copy began: the writer ends too
                    copying.failed(exc)
                    raise
        return time.perf_counter() - start

    def _write_and_commit(self, step: int, staged: dict[str, Any], tmp: Path, final: Path, copying: Staged) -> None:
        def write() -> None:
            size, digest = save_hashed(staged, tmp / MODEL_FILE, copying)
            self._commit(step, tmp, final, known={MODEL_FILE: (size, digest)})
        self._written(step, tmp, write, needed=state_bytes(staged))

    def start_writer(self, step: int, write: Callable[[], None], wait: bool = False) -> None:
        """Run `write` (it writes and commits `step`, e.g. training/ckpt/sharded.py's) on the writer
        thread, with the bookkeeping of our own background saves: a failure leaves no partial
        step and is reported; a success prunes and queues the upload. The next save, load and
        close wait for it (`wait`: this call does)."""
        tmp = self.local / f"{step_dir(step)}.tmp"
        writer = threading.Thread(target=self._written, args=(step, tmp, write), name="checkpoint-write", daemon=False)
        self.writes.start(writer)
        if wait:
            self.wait_commit()

    def commit_step(self, step: int, tmp: Path, final: Path) -> None:
        """Hash the files in `tmp`, write this node's manifest, rename: for writers of our format."""
        self._commit(step, tmp, final)

    def _written(self, step: int, tmp: Path, write: Callable[[], None], needed: int | None = None) -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 (disk full, I/O error): the step is not committed
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # DCP's CheckpointException is a BaseException
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # do not leave a partial step on a full disk
            why = write_failure(exc, self.local, needed)
            with self.uploads.lock:
                self.status.write_error = f"{step_dir(step)}: {why}"
            log.error("checkpoint %s could not be written: %s; the newest committed one stays the resume point",
                      step_dir(step), why)
            self.uploads.report()
            return
        with self.uploads.lock:
            self.status.last_commit, self.status.write_error = time.time(), ""
        self.uploads.prune_local()
        self.uploads.queue_upload(step)
        self.uploads.report()

    @property
    def write_error(self) -> str:
        return self.status.write_error

    @property
    def refused(self) -> str:
        """`URL: Code: message` once the store refused an upload for good (no such bucket, access
        denied), else "": the training loop stops (training/ckpt/run_control.py's say_refused)."""
        with self.uploads.lock:
            return self.status.permanent_error

    @property
    def writing(self) -> bool:
        """A checkpoint is being written in the background now (the loop's wall-cost accounting,
        training/wallcost.py)."""
        return self.writes.busy

    def wait_commit(self) -> None:
        """Until the checkpoint being written in the background is committed (or failed)."""
        self.writes.wait()

    def save_folder(self, step: int, source: Path, barrier: Callable[[], None]) -> float:
        """Commit a checkpoint another library wrote as a folder of files (a Hugging Face
        Trainer's `checkpoint-N/`, with FSDP's SHARDED_STATE_DICT its `pytorch_model_fsdp_0/`
        and `optimizer_0/` DCP subfolders too): each node's local rank 0 takes the tree its node
        wrote, hard-linked where the file system allows, under the same manifest (one entry per
        file, by relative path), upload and keep-K as our own. A symbolic link anywhere in it, or
        a name a manifest may not list, is refused before anything is copied (every rank raises).
        Every rank must call it. Returns the seconds the caller was blocked."""
        start = time.perf_counter()
        tmp = self.local / f"{step_dir(step)}.tmp"
        final = self.local / step_dir(step)
        self.wait_commit()
        if source.is_dir():
            names = [n for n in tree_files(source) if not re.fullmatch(r"manifest-node\d+\.json", n)]  # stale: dropped
            bad = [n for n in names if not plain_path(n)]
            if bad:
                raise CheckpointError(f"{source} holds {bad[0]!r}: not a plain file name a checkpoint may list "
                                      "(letters, digits, '._-'; dot files only inside a subfolder; no manifest-node* "
                                      "below the top); rename or remove it")
        barrier()
        if self.topo.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp, copy_function=link_or_copy)
            for stale in tmp.glob("manifest-node*.json"):
                stale.unlink()
            if final.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._commit(step, tmp, final)
            self.uploads.prune_local()
            self.uploads.queue_upload(step)
        barrier()
        return time.perf_counter() - start

    def _commit(self, step: int, tmp: Path, final: Path, known: dict[str, tuple[int, str]] | None = None) -> None:
        """The manifest (sizes and blake3_pieces of the step's files, training/ckpt/digest.py; `known`
        ones hashed and fsync'd while written, every other one fsync'd here) written last and
        fsync'd, then the folder renamed: the commit."""
        known = known or {}
        files = [n for n in tree_files(tmp) if not n.endswith(".part")]
        bad = [n for n in files if not plain_path(n)]
        if bad:
            raise CheckpointError(f"{tmp.name}/{bad[0]} is not a plain file name a manifest may list")
        for n in set(files) - set(known):  # the RNG files, an in-line model file, DCP's: on disk first
            fsync_path(tmp / n)
        entries = {n: {"size": known[n][0], digest.PIECES: known[n][1]} if n in known else digest.entry(tmp / n)
                   for n in files}
        manifest = {"format": digest.FORMAT, "step": step, "node": self.topo.node, "nnodes": self.topo.nnodes,
                    "world_size": self.topo.world_size, "ranks": list(self.topo.node_ranks),
                    "files": entries, "created": time.time()}
        path = tmp / manifest_name(self.topo.node)
        with path.open("w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        for sub in sorted({(tmp / n).parent for n in files} - {tmp}):
            fsync_dir(sub)
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(self.local)
        log.info("committed checkpoint %s locally (%d files)", final.name, len(files))

    def close(self, timeout: float = 120.0) -> UploadStatus:
        self.loader.wait_prefetch()  # no fetch left half-written
        self.wait_uploads(timeout)  # (the checkpoint a stop asked for committed first: wait_commit)
        self.uploads.stop()  # (lets an upload in flight finish, a few seconds at most)
        if self.lease is not None:
            self.lease.release()  # a restart of this run (or the next run) takes the prefix at once
        with self.uploads.lock:  # read after the stop, once (returned too): an upload finished in it is not kept
            status = self.status.snapshot()
        if status.pending:
            log.error("%d checkpoint(s) could not be uploaded to %s: %s (last error: %s); they are kept in %s and will "
                      "be uploaded when a run starts again with the store reachable", len(status.pending),
                      self.remote.url if self.remote else "-", [step_dir(s) for s in status.pending], status.last_error,
                      self.local)
        return status
