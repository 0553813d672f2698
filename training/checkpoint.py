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

Before a step is loaded, every file it needs is checked against its manifest (size and sha256)
and unpickled with weights_only; a step that fails is skipped with a log line naming why, its
bad local copy is fetched again from the bucket, and otherwise the previous step is used.

With a bucket, the local folder is `<checkpoint dir>/<run key>/`, the run key derived from the
checkpoint URL: two runs never share a cache. A lock file in it stops a second trainer on the
same run (the message names the holder).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import pickle
import queue
import re
import shutil
import socket
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tenacity import RetryError, Retrying, stop_after_attempt, wait_exponential

from tenacity import retry_if_exception

from training import digest
from training.fetch import fetch_verified
from training.staging import Stager, save_hashed

from training.storage import Location, StorageRefused, location, permanent_cause

log = logging.getLogger("gts.checkpoint")
STEP_RE = re.compile(r"^step-(\d{8})$")
MODEL_FILE = "model.pt"
# A file name a manifest may list: a plain name inside the step's folder (no path, no '..', no
# leading dot). Every name is checked before it is joined to a local path or a bucket key.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
# Inside a subfolder a leaf may also be a dot file (DCP's `.metadata`), never `.` or `..`.
DOT_LEAF = re.compile(r"^\.[A-Za-z0-9_][A-Za-z0-9._-]{0,198}$")
MAX_DEPTH = 8  # components of one listed path (a Trainer's FSDP folder has 2)
MAX_NODES = 4096


def plain_path(name: object) -> bool:
    """True for a name a manifest may list: a relative POSIX path (`pytorch_model_fsdp_0/__0_0.distcp`)
    whose every component is a plain name (no '', '.', '..', leading '/', backslash or NUL; folders
    never dot names), whose leaf may be a dot file only inside a subfolder, and which is never a
    manifest. Checked before a name is joined to a local path or a bucket key; symbolic links on
    disk are refused separately (`inside`)."""
    if not isinstance(name, str) or "\\" in name or "\x00" in name:
        return False
    parts = name.split("/")
    if not 1 <= len(parts) <= MAX_DEPTH or not all(FILE_NAME.fullmatch(p) for p in parts[:-1]):
        return False
    leaf = parts[-1]
    if leaf.startswith("manifest-node"):
        return False
    return bool(FILE_NAME.fullmatch(leaf) or (len(parts) > 1 and DOT_LEAF.fullmatch(leaf)))


def inside(folder: Path, name: str) -> Path:
    """`folder/name` for a listed name, after checking that the name is a plain path and that no
    component of it on disk (nor the folder) is a symbolic link and it resolves inside `folder`;
    else CheckpointError."""
    if not plain_path(name):
        raise CheckpointError(f"{name!r} is not a plain file name inside the step's folder")
    path = folder
    for part in [None, *name.split("/")]:
        path = path if part is None else path / part
        if path.is_symlink():
            raise CheckpointError(f"{folder.name}/{name} is a symbolic link: a checkpoint holds files only")
    if folder.exists() and not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{folder.name}/{name} resolves outside the step's folder")
    return path


def tree_files(folder: Path) -> list[str]:
    """The files under `folder` as relative POSIX paths, sorted; CheckpointError when one is a
    symbolic link (file or folder) or neither a file nor a folder. Never follows a link."""
    found = []
    for here, dirs, names in os.walk(folder, followlinks=False):
        base = Path(here)
        for entry in sorted(dirs) + sorted(names):
            path = base / entry
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                raise CheckpointError(f"{folder}/{rel} is a symbolic link: a checkpoint holds files only")
            if path.is_file():
                found.append(rel)
            elif not path.is_dir():
                raise CheckpointError(f"{folder}/{rel} is not a file or a folder")
    return sorted(found)


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def manifest_name(node: int) -> str:
    return f"manifest-node{node:03d}.json"


def rng_name(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def run_key(url: str) -> str:
    """The local cache folder of a run: readable, and unique per checkpoint URL."""
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", url.split("://", 1)[-1]).strip("_")[-60:]
    return f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"


class CheckpointError(Exception):
    """A step that cannot be used (the message says which file and why)."""


def check_manifest(manifest: Any, step: int, where: str) -> dict[str, Any]:
    """`manifest` if it is one of `step` whose every file lies in the step's folder; else
    CheckpointError naming what is wrong (a hostile or hand-edited manifest is never used)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{where}: not a manifest")
    if manifest.get("step") != step:
        raise CheckpointError(f"{where} is the manifest of step {manifest.get('step')!r}, not of {step_dir(step)} "
                              "(a renamed or copied folder): not used")
    version = manifest.get("format", 1)
    if not isinstance(version, int) or version > digest.FORMAT:
        raise CheckpointError(f"{where} has manifest format {version!r}; this version of training/ reads formats "
                              f"1 to {digest.FORMAT}: resume it with the version that wrote it, or a newer one")
    nnodes = manifest.get("nnodes", 1)
    if not isinstance(nnodes, int) or not 1 <= nnodes <= MAX_NODES:
        raise CheckpointError(f"{where}: nnodes {nnodes!r} is not a node count")
    for name, meta in manifest["files"].items():
        if not plain_path(name):
            raise CheckpointError(f"{where} lists {name!r}: not a plain file name inside the step's folder; "
                                  "the step is not used")
        if not digest.vouched(meta):
            raise CheckpointError(f"{where}: the entry of {name!r} has no size and sha256")
    return manifest


class RunLocked(Exception):
    """Another trainer holds this run's checkpoint folder."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (no second copy of a large file) where the file system allows one."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
    last_commit: float = 0.0  # when the newest checkpoint was committed locally
    write_error: str = ""  # why the last background write failed ("" when it did not)
    permanent_error: str = ""  # the store's answer no retry changes (URL: Code: message), if any


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


class CheckpointManager:
    """save / load / close. One per process; collectives stay in the caller."""

    def __init__(self, local_dir: str, remote_url: str | None, topo: Topology, keep: int = 3,
                 upload_attempts: int = 4, on_status: Callable[[UploadStatus], None] | None = None,
                 background: bool = True):
        self.local = Path(local_dir) / run_key(remote_url) if remote_url else Path(local_dir)
        self.remote: Location | None = location(remote_url) if remote_url else None
        self.remote_error = ""  # why the bucket could not be listed at start, if it could not
        self._told: set[str] = set()  # warnings already logged (a bad folder is named once)
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
        self._held = _lock(self.local) if topo.local_rank == 0 else None
        if topo.local_rank == 0:
            for stale in self.local.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)  # a crash mid-write: never committed
        self.background = background  # False: the caller waits for the write and the commit (make bench compares)
        self._stager = Stager()
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._prefetch: threading.Thread | None = None
        self._prefetched: tuple[int, tuple[dict[str, Any], dict[str, Any] | None]] | None = None
        if self.remote is not None and topo.local_rank == 0:
            self._thread = threading.Thread(target=self._uploader, name="checkpoint-upload", daemon=True)
            self._thread.start()

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
        _save(rng_state, tmp / rng_name(self.topo.rank))
        barrier()
        if self.topo.local_rank == 0:
            assert model_state is not None
            if final.exists():  # committed before (the caller normally skips this)
                shutil.rmtree(tmp, ignore_errors=True)
            elif not self.background:
                _save(model_state, tmp / MODEL_FILE)
                self._commit(step, tmp, final)
                self._prune_local()
                self._queue_upload(step)
            else:
                staged = self._stager.stage(model_state)
                # Not a daemon: an exiting process waits for the checkpoint it already reported.
                writer = threading.Thread(target=self._write_and_commit, args=(step, staged, tmp, final),
                                          name="checkpoint-write", daemon=False)
                with self._writer_lock:
                    self._writer = writer
                writer.start()
        return time.perf_counter() - start

    def _write_and_commit(self, step: int, staged: dict[str, Any], tmp: Path, final: Path) -> None:
        def write() -> None:
            size, digest = save_hashed(staged, tmp / MODEL_FILE)
            self._commit(step, tmp, final, known={MODEL_FILE: (size, digest)})
        self._written(step, tmp, write)

    def start_writer(self, step: int, write: Callable[[], None], wait: bool = False) -> None:
        """Run `write` (it writes and commits `step`, e.g. training/sharded.py's) on the writer
        thread, with the bookkeeping of our own background saves: a failure leaves no partial
        step and is reported; a success prunes and queues the upload. The next save, load and
        close wait for it (`wait`: this call does)."""
        tmp = self.local / f"{step_dir(step)}.tmp"
        writer = threading.Thread(target=self._written, args=(step, tmp, write), name="checkpoint-write", daemon=False)
        with self._writer_lock:
            self._writer = writer
        writer.start()
        if wait:
            self.wait_commit()

    def commit_step(self, step: int, tmp: Path, final: Path) -> None:
        """Hash the files in `tmp`, write this node's manifest, rename: for writers of our format."""
        self._commit(step, tmp, final)

    def _written(self, step: int, tmp: Path, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 (disk full, I/O error): the step is not committed
            shutil.rmtree(tmp, ignore_errors=True)  # do not leave a partial step on a full disk
            with self._lock:
                self.status.write_error = f"{step_dir(step)}: {type(exc).__name__}: {exc}"
            log.error("checkpoint %s could not be written: %s; the newest committed one stays the resume point",
                      step_dir(step), exc)
            self._report()
            return
        with self._lock:
            self.status.last_commit, self.status.write_error = time.time(), ""
        self._prune_local()
        self._queue_upload(step)
        self._report()

    @property
    def write_error(self) -> str:
        return self.status.write_error

    @property
    def writing(self) -> bool:
        """A checkpoint is being written in the background now (the loop's wall-cost accounting,
        training/wallcost.py)."""
        with self._writer_lock:
            writer = self._writer
        return writer is not None and writer.is_alive()

    def wait_commit(self) -> None:
        """Until the checkpoint being written in the background is committed (or failed). The
        writer and the upload thread never wait for it (the writer is what they would wait for;
        the upload thread only lists steps)."""
        with self._writer_lock:
            writer = self._writer
        if writer is None or threading.current_thread() in (writer, self._thread):
            return
        writer.join()
        with self._writer_lock:
            if self._writer is writer:  # a newer writer may have started meanwhile: keep it
                self._writer = None

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
            shutil.copytree(source, tmp, copy_function=_link_or_copy)
            for stale in tmp.glob("manifest-node*.json"):
                stale.unlink()
            if final.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._commit(step, tmp, final)
            self._prune_local()
            self._queue_upload(step)
        barrier()
        return time.perf_counter() - start

    def _queue_upload(self, step: int) -> None:
        if self.remote is None:
            return
        with self._lock:
            if step not in self.status.pending:
                self.status.pending.append(step)
        self._idle.clear()
        self._queue.put(step)

    def _commit(self, step: int, tmp: Path, final: Path, known: dict[str, tuple[int, str]] | None = None) -> None:
        """The manifest (sizes and sha256_pieces of the step's files, training/digest.py; `known`
        ones hashed while written) written last and fsync'd, then the folder renamed: the commit."""
        known = known or {}
        files = [n for n in tree_files(tmp) if not n.endswith(".part")]
        bad = [n for n in files if not plain_path(n)]
        if bad:
            raise CheckpointError(f"{tmp.name}/{bad[0]} is not a plain file name a manifest may list")
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
            _fsync_dir(sub)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(self.local)
        log.info("committed checkpoint %s locally (%d files)", final.name, len(files))

    # ------------------------------------------------------------------ find / load
    def _local_manifests(self, step: int) -> list[dict[str, Any]]:
        """The step's manifests on this disk that are its own (see check_manifest); one that is
        not is logged once and makes the step not committed here."""
        folder = self.local / step_dir(step)
        found = []
        for path in sorted(folder.glob("manifest-node*.json")):
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            try:
                found.append(check_manifest(manifest, step, f"{folder.name}/{path.name}"))
            except CheckpointError as exc:
                if str(exc) not in self._told:
                    self._told.add(str(exc))
                    log.warning("%s", exc)
                return []
        return found

    def local_steps(self) -> list[int]:
        """Committed steps on this node's disk (a manifest of that step is in: the step is the
        manifest's, never the folder name's; checked file by file on load)."""
        self.wait_commit()
        steps = [int(m.group(1)) for p in self.local.iterdir() if (m := STEP_RE.match(p.name)) and not p.is_symlink()]
        return sorted(s for s in steps if self._local_manifests(s))

    def remote_steps(self) -> list[int]:
        """Steps whose every node's manifest is in the bucket. An unreachable bucket gives none
        (and `remote_error` says why): the run goes on from its local steps."""
        if self.remote is None:
            return []
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.remote.fs.ls(self.remote.root, detail=False)]
        except Exception as exc:  # noqa: BLE001 (botocore / aiohttp errors are not all OSError)
            cause = permanent_cause(exc)
            if cause is not None:  # no retry helps: say so now, not after minutes of retries
                raise StorageRefused(f"{self.remote.url}: {cause}") from None
            if isinstance(exc, FileNotFoundError):
                return []  # nothing under the prefix yet
            self.remote_error = f"{type(exc).__name__}: {exc}"
            return []
        found = []
        for name in names:
            m = STEP_RE.match(name)
            if not m:
                continue
            try:
                listing = {p.rsplit("/", 1)[-1] for p in self.remote.fs.ls(self.remote.join(name), detail=False)}
                first = json.loads(self.remote.fs.cat(self.remote.join(name, manifest_name(0))))
            except Exception:  # noqa: BLE001 (a missing or damaged manifest: not a complete step)
                continue
            try:
                check_manifest(first, int(m.group(1)), f"{self.remote.url}/{name}/{manifest_name(0)}")
            except CheckpointError as exc:
                if str(exc) not in self._told:
                    self._told.add(str(exc))
                    log.warning("%s", exc)
                continue
            if all(manifest_name(n) in listing for n in range(int(first["nnodes"]))):
                found.append(int(m.group(1)))
        return sorted(found)

    def loadable_steps(self) -> set[int]:
        """Steps this node may restore, from its disk or the bucket (checked when loaded)."""
        return set(self.local_steps()) | set(self.remote_steps())

    def prefetch(self) -> None:
        """Start loading the newest step (local or in the bucket: fetched, checked, mapped) on a
        background thread, so that it overlaps what the caller does next (imports, building the
        model). `load` of that step then returns its result; a fault found there is not kept:
        `load` tries again and reports it as usual."""
        if self._prefetch is None:
            self._prefetch = threading.Thread(target=self._load_newest, name="checkpoint-prefetch", daemon=True)
            self._prefetch.start()

    def _load_newest(self) -> None:
        try:
            steps = sorted(self.loadable_steps())
            if steps:
                self._prefetched = (steps[-1], self.load(steps[-1]))
        except Exception as exc:  # noqa: BLE001 (load, on the caller's thread, meets it again and says so)
            log.debug("prefetch: %s", exc)

    def _take_prefetched(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        prefetch = self._prefetch
        if prefetch is None or threading.current_thread() is prefetch:
            return None
        prefetch.join()
        found, self._prefetched = self._prefetched, None
        return found[1] if found is not None and found[0] == step else None

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(model state, this rank's RNG state or None when the step was saved with another
        world size) for `step`: every file checked against its manifest first; a bad local copy
        is fetched again from the bucket. Raises CheckpointError naming the file and the fault."""
        prefetched = self._take_prefetched(step)
        if prefetched is not None:
            return prefetched
        self.wait_commit()
        folder = self.local / step_dir(step)
        manifests = self._local_manifests(step)
        try:
            files, world = self._needed(manifests)
            self._verify(folder, files)
        except CheckpointError as local_fault:
            if self.remote is None:
                raise
            if manifests:
                log.warning("rank %d: local %s is damaged (%s); fetching it from %s", self.topo.rank,
                            step_dir(step), local_fault, self.remote.url)
            manifests = self._remote_manifests(step)
            files, world = self._needed(manifests)
            self._download(step, folder, files)  # each file checked there (fetched and hashed, or already good)
        model = self._unpickle(folder / MODEL_FILE)
        rng = self._unpickle(folder / rng_name(self.topo.rank)) if rng_name(self.topo.rank) in files else None
        return model, rng

    def load_folder(self, step: int) -> Path:
        """A step saved with `save_folder`, every file of every node checked (fetched from the
        bucket where missing or bad here): the local folder holding them."""
        self.wait_commit()
        folder = self.local / step_dir(step)
        manifests = self._local_manifests(step)
        try:
            files = self._all_files(manifests)
            self._verify(folder, files)
        except CheckpointError:
            if self.remote is None:
                raise
            manifests = self._remote_manifests(step)
            files = self._all_files(manifests)
            self._download(step, folder, files)  # each file checked there
        return folder

    def _all_files(self, manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not manifests or len(manifests) < int(manifests[0].get("nnodes", 1)):
            raise CheckpointError("the manifests of some nodes are missing")
        return {name: meta for m in manifests for name, meta in m.get("files", {}).items()}

    def _needed(self, manifests: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], int]:
        """The files this rank loads, with their manifest entries, and the step's world size."""
        if not manifests:
            raise CheckpointError("no manifest")
        world = int(manifests[0].get("world_size", self.topo.world_size))
        listed = {name: meta for m in manifests for name, meta in m.get("files", {}).items()}
        wanted = [MODEL_FILE] + ([rng_name(self.topo.rank)] if world == self.topo.world_size else [])
        missing = [name for name in wanted if name not in listed]
        if missing:
            raise CheckpointError(f"the manifest lists no {', '.join(missing)}")
        return {name: listed[name] for name in wanted}, world

    @staticmethod
    def _verify(folder: Path, files: dict[str, dict[str, Any]]) -> None:
        """Each file's size and sha256 against its manifest entry."""
        for name, meta in files.items():
            path = inside(folder, name)  # a plain relative path, no symbolic link on the way
            try:
                size = path.stat().st_size
            except OSError:
                raise CheckpointError(f"{name} is missing") from None
            if size != meta["size"]:
                raise CheckpointError(f"{name} has {size} bytes, the manifest says {meta['size']}")
            if not digest.matches(path, meta):
                raise CheckpointError(f"{name} does not match its sha256 in the manifest")

    @staticmethod
    def _unpickle(path: Path) -> dict[str, Any]:
        # weights_only: a checkpoint in a shared bucket must not be able to run code when loaded;
        # a damaged file and one carrying code both fail here, and neither is ever used. mmap: the
        # tensors are the file's pages (just verified, so in the page cache), not a second copy of
        # them; load_state_dict then copies them once into the model (issue 34: resume speed).
        # A mapping is private (copy on write) and outlives the file's removal by keep-K.
        try:
            try:
                return dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return dict(torch.load(path, map_location="cpu", weights_only=True))  # a legacy (non-zip) file
        except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as exc:
            text = str(exc)
            detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0] if text.strip() else ""
            raise CheckpointError(f"{path.name} cannot be read as tensors and plain values: {detail[:160]}") from None

    def _remote_manifests(self, step: int) -> list[dict[str, Any]]:
        assert self.remote is not None
        try:
            first = check_manifest(json.loads(self.remote.fs.cat(self.remote.join(step_dir(step), manifest_name(0)))),
                                   step, f"{self.remote.url}/{step_dir(step)}/{manifest_name(0)}")
            return [first] + [check_manifest(json.loads(self.remote.fs.cat(self.remote.join(step_dir(step),
                                                                                           manifest_name(n)))),
                                             step, f"{self.remote.url}/{step_dir(step)}/{manifest_name(n)}")
                              for n in range(1, int(first["nnodes"]))]
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"its manifests cannot be read from {self.remote.url}: {exc}") from None

    def _download(self, step: int, folder: Path, files: dict[str, dict[str, Any]]) -> None:
        """Fetch the files that are missing or bad here; one rank of the node at a time (a lock
        file), each file replaced atomically, so ranks reading it meanwhile keep a whole file."""
        assert self.remote is not None
        bad = [name for name in files if not plain_path(name)]
        if bad or folder.is_symlink():
            raise CheckpointError(f"{bad[0]!r} is not a plain file name inside the step's folder" if bad else
                                  f"{folder} is a symbolic link: not written through")
        folder.mkdir(parents=True, exist_ok=True)
        with (folder.parent / f".{step_dir(step)}.fetch").open("a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for name, meta in files.items():
                target = inside(folder, name)  # a symbolic link on disk (say a linked subfolder) is refused
                try:
                    self._verify(folder, {name: meta})
                    continue  # another rank fetched it already
                except CheckpointError:
                    pass
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)  # a subfolder of the step (FSDP's DCP folders)
                except OSError as exc:
                    raise CheckpointError(f"{folder.name}/{name}: its folder cannot be made: {exc}") from None
                target = inside(folder, name)  # and still none after creating the subfolders
                part = target.with_name(f"{target.name}.{self.topo.rank}.download")
                url = self.remote.url

                def fault(why: str, name: str = name) -> CheckpointError:
                    return CheckpointError(f"{name} in {url} {why}")
                try:  # one pass: hashed as it arrives (training/fetch.py), never read back
                    fetch_verified(self.remote.fs, self.remote.join(step_dir(step), name), part, meta, fault)
                except CheckpointError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    raise CheckpointError(f"{name} cannot be fetched from {self.remote.url}: {exc}") from None
                os.replace(part, target)
            for n, manifest in enumerate(self._remote_manifests(step)):
                path = folder / manifest_name(n)
                if not path.exists():
                    path.write_text(json.dumps(manifest, indent=1))
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
                # Transient faults (timeouts, 5xx, a dropped connection) are retried quietly; an
                # answer no retry changes (no such bucket, access denied) stops at once.
                for attempt in Retrying(stop=stop_after_attempt(self.attempts), reraise=False,
                                        retry=retry_if_exception(lambda e: permanent_cause(e) is None),
                                        wait=wait_exponential(multiplier=0.5, max=8)):
                    with attempt:
                        self._upload(step)
            except RetryError as exc:
                error = exc.last_attempt.exception()
                assert error is not None
                cause = permanent_cause(error)
                with self._lock:
                    self.status.last_error = f"{step_dir(step)}: {cause or error}"
                    if cause:
                        self.status.permanent_error = f"{self.remote.url if self.remote else ''}: {cause}"
                if cause:
                    log.error("upload of %s refused by %s (%s): not retried; kept locally", step_dir(step),
                              self.remote.url if self.remote else "", cause)
                else:
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
        """This node's files of `step`, then its manifest (the commit). A folder fetched from the
        bucket on an earlier start may hold other nodes' manifests: their files are there already."""
        assert self.remote is not None
        folder = self.local / step_dir(step)
        for path in sorted(folder.glob("manifest-node*.json")):
            manifest = check_manifest(json.loads(path.read_text()), step, f"{folder.name}/{path.name}")
            names = sorted(manifest["files"])
            if self.topo.rank != 0:
                names = [n for n in names if n != MODEL_FILE]  # global rank 0 uploads the shared file
            for name in names:
                local = inside(folder, name)  # each file under its relative key (subfolders as key prefixes)
                if local.exists():
                    self.remote.fs.put(str(local), self.remote.join(step_dir(step), name))
            self.remote.fs.put(str(path), self.remote.join(step_dir(step), path.name))

    def resync(self) -> None:
        """Queue committed local steps the bucket lacks (an outage during an earlier run)."""
        if self.remote is None or self.topo.local_rank != 0:
            return
        have = set(self.remote_steps())
        if self.remote_error:
            log.warning("cannot list %s (%s); training goes on from local state and uploads are retried "
                        "in the background", self.remote.url, self.remote_error)
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
        except (OSError, StorageRefused) as exc:
            log.warning("could not prune old checkpoints in %s: %s", self.remote.url, exc)

    def _report(self) -> None:
        if self.on_status is not None:
            with self._lock:
                snapshot = UploadStatus(list(self.status.pending), self.status.last_success,
                                        self.status.last_error, list(self.status.uploaded), self.status.last_commit,
                                        self.status.write_error, self.status.permanent_error)
            self.on_status(snapshot)

    def wait_uploads(self, timeout: float) -> bool:
        """Block until the queue is drained (True) or `timeout` passes (False)."""
        self.wait_commit()
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle.wait(timeout=0.5) and not self.status.pending:
                return True
            if self.status.permanent_error:
                return False  # waiting changes nothing
            if self._idle.is_set() and self.status.pending:
                self._idle.clear()
                self._queue.put(self.status.pending[-1])  # retry now
        return not self.status.pending

    def close(self, timeout: float = 120.0) -> UploadStatus:
        if self._prefetch is not None:
            self._prefetch.join()  # no fetch left half-written
        self.wait_commit()  # a stop waits for the checkpoint it asked for
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
