"""Checkpoints that survive spot reclaims: written locally first, committed atomically, then
uploaded in the background to object storage.

Layout, locally and in the bucket:

    <root>/step-00000040/model.pt            model, optimizer, scaler, LR schedule, step, epoch,
                                             sampler offset (written by each node's local rank 0)
    <root>/step-00000040/rng-rank00003.pt    one per rank: python, numpy, torch and CUDA RNG
    <root>/step-00000040/manifest-node000.json   sizes and sha256 of this node's files; written
                                             last, it is the commit: a step without it does not exist

Locally the files are written into `step-N.tmp/` and renamed to `step-N/` once the manifest is
in: a crash leaves only a `.tmp` directory, which is never read and is removed on the next start.
Only global rank 0 uploads `model.pt`; each node uploads its ranks' RNG files and its manifest,
manifest last. A step is resumable from the bucket when the manifests of all its nodes are there.
The newest K steps are kept locally and in the bucket; a step not yet uploaded is never deleted
locally. Uploads that fail are retried with backoff and again on every later checkpoint and at
start-up, so an outage of the store never stops training and nothing committed is lost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tenacity import RetryError, Retrying, stop_after_attempt, wait_exponential

from training.storage import Location, location

log = logging.getLogger("gts.checkpoint")
STEP_RE = re.compile(r"^step-(\d{8})$")
MODEL_FILE = "model.pt"


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def manifest_name(node: int) -> str:
    return f"manifest-node{node:03d}.json"


def rng_name(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    with tmp.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class Topology:
    rank: int
    local_rank: int
    world_size: int
    node: int
    nnodes: int
    local_world_size: int

    @property
    def node_ranks(self) -> range:
        return range(self.node * self.local_world_size, (self.node + 1) * self.local_world_size)


@dataclass
class UploadStatus:
    pending: list[int] = field(default_factory=list)
    last_success: float = 0.0
    last_error: str = ""
    uploaded: list[int] = field(default_factory=list)


class CheckpointManager:
    """save / load / close. One per process; collectives stay in the caller."""

    def __init__(self, local_dir: str, remote_url: str | None, topo: Topology, keep: int = 3,
                 upload_attempts: int = 4, on_status: Callable[[UploadStatus], None] | None = None):
        self.local = Path(local_dir)
        self.remote: Location | None = location(remote_url) if remote_url else None
        self.topo = topo
        self.keep = keep
        self.attempts = upload_attempts
        self.status = UploadStatus()
        self.on_status = on_status
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self.local.mkdir(parents=True, exist_ok=True)
        if topo.local_rank == 0:
            for stale in self.local.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)  # a crash mid-write: never committed
        self._thread: threading.Thread | None = None
        if self.remote is not None and topo.local_rank == 0:
            self._thread = threading.Thread(target=self._uploader, name="checkpoint-upload", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ save
    def save(self, step: int, model_state: dict[str, Any] | None, rng_state: dict[str, Any],
             barrier: Callable[[], None]) -> float:
        """Write this rank's part of step `step`; local rank 0 also writes the model state (pass
        None elsewhere) and commits. Returns the seconds the caller was blocked. Every rank
        must call it (it runs `barrier` between the data files and the commit)."""
        start = time.perf_counter()
        tmp = self.local / f"{step_dir(step)}.tmp"
        final = self.local / step_dir(step)
        if self.topo.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        _save(rng_state, tmp / rng_name(self.topo.rank))
        if self.topo.local_rank == 0:
            assert model_state is not None
            _save(model_state, tmp / MODEL_FILE)
        barrier()
        if self.topo.local_rank == 0:
            if final.exists():  # committed before (the caller normally skips this)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._commit(step, tmp, final)
            self._prune_local()
            if self.remote is not None:
                with self._lock:
                    if step not in self.status.pending:
                        self.status.pending.append(step)
                self._idle.clear()
                self._queue.put(step)
        barrier()
        return time.perf_counter() - start

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        files = sorted(p for p in tmp.iterdir() if p.is_file() and not p.name.endswith(".part"))
        manifest = {"step": step, "node": self.topo.node, "nnodes": self.topo.nnodes,
                    "world_size": self.topo.world_size, "ranks": list(self.topo.node_ranks),
                    "files": {p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)} for p in files},
                    "created": time.time()}
        path = tmp / manifest_name(self.topo.node)
        with path.open("w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(self.local)
        log.info("committed checkpoint %s locally (%d files)", final.name, len(files))

    # ------------------------------------------------------------------ find / load
    def _valid_local(self, step: int) -> bool:
        folder = self.local / step_dir(step)
        path = folder / manifest_name(self.topo.node)
        try:
            manifest = json.loads(path.read_text())
            for name, meta in manifest["files"].items():
                if (folder / name).stat().st_size != meta["size"]:
                    return False
            return True
        except (OSError, ValueError, KeyError):
            return False

    def local_steps(self) -> list[int]:
        steps = [int(m.group(1)) for p in self.local.iterdir() if (m := STEP_RE.match(p.name))]
        return sorted(s for s in steps if self._valid_local(s))

    def remote_steps(self) -> list[int]:
        if self.remote is None:
            return []
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.remote.fs.ls(self.remote.root, detail=False)]
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = STEP_RE.match(name)
            if not m:
                continue
            try:
                listing = {p.rsplit("/", 1)[-1] for p in self.remote.fs.ls(self.remote.join(name), detail=False)}
                first = json.loads(self.remote.fs.cat(self.remote.join(name, manifest_name(0))))
            except (FileNotFoundError, ValueError):
                continue
            if all(manifest_name(n) in listing for n in range(int(first["nnodes"]))):
                found.append(int(m.group(1)))
        return sorted(found)

    def loadable_steps(self) -> set[int]:
        """Steps this node can restore, from its disk or the bucket."""
        return set(self.local_steps()) | set(self.remote_steps())

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, this rank's RNG state) for `step`, fetching from the bucket if needed."""
        folder = self.local / step_dir(step)
        if not self._valid_local(step):
            self._download(step, folder)
        # weights_only: a checkpoint in a shared bucket must not be able to run code when loaded.
        model = torch.load(folder / MODEL_FILE, map_location="cpu", weights_only=True)
        rng = torch.load(folder / rng_name(self.topo.rank), map_location="cpu", weights_only=True)
        return model, rng

    def _download(self, step: int, folder: Path) -> None:
        assert self.remote is not None
        # Every rank of the node may get here; files land under a per-rank temp name first.
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(exist_ok=True)
        wanted = [MODEL_FILE, rng_name(self.topo.rank)]
        manifests = [json.loads(self.remote.fs.cat(self.remote.join(step_dir(step), manifest_name(n))))
                     for n in range(self.topo.nnodes)]
        sizes = {k: v for m in manifests for k, v in m["files"].items()}
        for name in wanted:
            target = folder / name
            if target.exists() and target.stat().st_size == sizes[name]["size"]:
                continue
            part = folder / f"{name}.{self.topo.rank}.download"
            self.remote.fs.get(self.remote.join(step_dir(step), name), str(part))
            if sha256_of(part) != sizes[name]["sha256"]:
                raise OSError(f"{step_dir(step)}/{name}: sha256 mismatch after download")
            os.replace(part, target)
        log.info("rank %d fetched %s from %s", self.topo.rank, step_dir(step), self.remote.url)

    # ------------------------------------------------------------------ upload
    def _uploader(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._upload_pending()
            if self._queue.empty():
                self._idle.set()

    def _upload_pending(self) -> None:
        with self._lock:
            steps = sorted(self.status.pending)
        for step in steps:
            try:
                for attempt in Retrying(stop=stop_after_attempt(self.attempts), reraise=False,
                                        wait=wait_exponential(multiplier=0.5, max=8)):
                    with attempt:
                        self._upload(step)
            except RetryError as exc:
                error = exc.last_attempt.exception()
                with self._lock:
                    self.status.last_error = f"{step_dir(step)}: {error}"
                log.warning("upload of %s failed (%s); kept locally, will retry", step_dir(step), error)
                self._report()
                return  # keep order: newer steps wait for older ones
            with self._lock:
                self.status.pending.remove(step)
                self.status.uploaded.append(step)
                self.status.last_success = time.time()
                self.status.last_error = ""
            log.info("uploaded %s to %s", step_dir(step), self.remote.url if self.remote else "")
            self._prune_remote()
            self._prune_local()
            self._report()

    def _upload(self, step: int) -> None:
        assert self.remote is not None
        folder = self.local / step_dir(step)
        manifest = json.loads((folder / manifest_name(self.topo.node)).read_text())
        names = sorted(manifest["files"])
        if self.topo.rank != 0:
            names = [n for n in names if n != MODEL_FILE]  # global rank 0 uploads the shared file
        for name in names:
            self.remote.fs.put(str(folder / name), self.remote.join(step_dir(step), name))
        self.remote.fs.put(str(folder / manifest_name(self.topo.node)),
                           self.remote.join(step_dir(step), manifest_name(self.topo.node)))

    def resync(self) -> None:
        """Queue committed local steps the bucket lacks (an outage during an earlier run)."""
        if self.remote is None or self.topo.local_rank != 0:
            return
        try:
            have = set(self.remote_steps())
        except OSError as exc:
            log.warning("cannot list %s (%s); will retry uploads later", self.remote.url, exc)
            have = set()
        missing = [s for s in self.local_steps()[-self.keep:] if s not in have]
        if missing:
            log.info("uploading %d checkpoint(s) missing from the bucket: %s", len(missing), missing)
            with self._lock:
                self.status.pending = sorted(set(self.status.pending) | set(missing))
            self._idle.clear()
            self._queue.put(missing[-1])

    def _prune_local(self) -> None:
        steps = self.local_steps()
        with self._lock:
            pending = set(self.status.pending)
        for step in steps[:-self.keep]:
            if step not in pending:
                shutil.rmtree(self.local / step_dir(step), ignore_errors=True)

    def _prune_remote(self) -> None:
        if self.remote is None or self.topo.rank != 0:
            return
        try:
            steps = self.remote_steps()
            for step in steps[:-self.keep]:
                self.remote.fs.rm(self.remote.join(step_dir(step)), recursive=True)
        except OSError as exc:
            log.warning("could not prune old checkpoints in %s: %s", self.remote.url, exc)

    def _report(self) -> None:
        if self.on_status is not None:
            with self._lock:
                snapshot = UploadStatus(list(self.status.pending), self.status.last_success,
                                        self.status.last_error, list(self.status.uploaded))
            self.on_status(snapshot)

    def wait_uploads(self, timeout: float) -> bool:
        """Block until the queue is drained (True) or `timeout` passes (False)."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle.wait(timeout=0.5) and not self.status.pending:
                return True
            if self._idle.is_set() and self.status.pending:
                self._idle.clear()
                self._queue.put(self.status.pending[-1])  # retry now
        return not self.status.pending

    def close(self, timeout: float = 120.0) -> UploadStatus:
        ok = self.wait_uploads(timeout)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
        if not ok:
            log.error("%d checkpoint(s) could not be uploaded to %s: %s (last error: %s); they are kept "
                      "in %s and will be uploaded when a run starts again with the store reachable",
                      len(self.status.pending), self.remote.url if self.remote else "-",
                      [step_dir(s) for s in self.status.pending], self.status.last_error, self.local)
        return self.status
