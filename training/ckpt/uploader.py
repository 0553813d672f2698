"""Uploading committed steps and keeping K (the Uploader a CheckpointManager holds): a background
thread uploads each node's files, manifest last, retrying transient faults with backoff and
stopping at once on answers no retry changes; old steps are pruned locally and in the bucket."""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable

from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from training.ckpt.files import MODEL_FILE, UploadStatus, check_manifest, inside, step_dir
from training.ckpt.loader import Loader
from training.ckpt.storage import StorageRefused, permanent_cause

log = logging.getLogger("gts.checkpoint")


class Uploader:
    """Uploads and keep-K for one manager's folder and bucket (CheckpointManager holds one); what
    is where it asks the manager's Loader (local_steps, remote_steps)."""

    def __init__(self, loader: Loader, keep: int, attempts: int, on_status: Callable[[UploadStatus], None] | None):
        self.loader = loader
        self.local, self.remote, self.topo = loader.local, loader.remote, loader.topo
        self.keep = keep
        self.attempts = attempts
        self.status = UploadStatus()
        self.on_status = on_status
        self.lock = threading.Lock()  # guards status (the loop, the writer and this thread update it)
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """The upload thread (a node's local rank 0, with a bucket)."""
        self.thread = threading.Thread(target=self._uploader, name="checkpoint-upload", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self._queue.put(None)
            self.thread.join(timeout=5)

    def queue_upload(self, step: int) -> None:
        if self.remote is None:
            return
        with self.lock:
            if step not in self.status.pending:
                self.status.pending.append(step)
        self._idle.clear()
        self._queue.put(step)

    def _uploader(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._upload_pending()
            if self._queue.empty():
                self._idle.set()

    def _upload_pending(self) -> None:
        with self.lock:
            steps = sorted(self.status.pending)
            if self.status.permanent_error:  # refused, or another run took the prefix: write nothing there
                return
        for step in steps:
            try:
                # Transient faults (timeouts, 5xx, a dropped connection) are retried quietly; an
                # answer no retry changes (no such bucket, access denied) stops at once: tenacity
                # then raises it as it is (no RetryError), so both are caught here, and nothing
                # leaves this thread as a traceback.
                for attempt in Retrying(stop=stop_after_attempt(self.attempts), reraise=False,
                                        retry=retry_if_exception(lambda e: permanent_cause(e) is None),
                                        wait=wait_exponential(multiplier=0.5, max=8)):
                    with attempt:
                        self._upload(step)
            except Exception as exc:  # noqa: BLE001 (the loop learns of it through status; see _failed)
                error = exc.last_attempt.exception() if isinstance(exc, RetryError) else exc
                self._failed(step, error or exc)
                return  # keep order: newer steps wait for older ones
            with self.lock:
                self.status.pending.remove(step)
                self.status.uploaded.append(step)
                self.status.last_success = time.time()
                self.status.last_error = ""
            log.info("uploaded %s to %s", step_dir(step), self.remote.url if self.remote else "")
            self._prune_remote()
            self.prune_local()
            self.report()

    def _failed(self, step: int, error: BaseException) -> None:
        """Note why `step` could not be uploaded: a permanent answer stops the run (the loop reads
        status.permanent_error after each step); anything else is retried later."""
        cause = permanent_cause(error)
        url = self.remote.url if self.remote else ""
        with self.lock:
            self.status.last_error = f"{step_dir(step)}: {cause or f'{type(error).__name__}: {error}'}"
            if cause:
                self.status.permanent_error = f"{url}: {cause}"
        if cause:
            log.error("upload of %s refused by %s (%s): not retried; kept locally in %s", step_dir(step), url, cause,
                      self.local / step_dir(step))
        else:
            log.warning("upload of %s failed (%s: %s); kept locally, will retry", step_dir(step),
                        type(error).__name__, error)
        self.report()

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
        have = set(self.loader.listed())  # (the listing the resume chose from, when a fetch process handed it over)
        if self.loader.remote_error:
            log.warning("cannot list %s (%s); training goes on from local state and uploads are retried "
                        "in the background", self.remote.url, self.loader.remote_error)
        missing = [s for s in self.loader.local_steps()[-self.keep:] if s not in have]
        if missing:
            log.info("uploading %d checkpoint(s) missing from the bucket: %s", len(missing), missing)
            with self.lock:
                self.status.pending = sorted(set(self.status.pending) | set(missing))
            self._idle.clear()
            self._queue.put(missing[-1])

    def prune_local(self) -> None:
        steps = self.loader.local_steps()
        with self.lock:
            pending = set(self.status.pending)
        for step in steps[:-self.keep]:
            if step not in pending:
                shutil.rmtree(self.local / step_dir(step), ignore_errors=True)

    def _prune_remote(self) -> None:
        if self.remote is None or self.topo.rank != 0:
            return
        try:
            steps = self.loader.remote_steps()
            for step in steps[:-self.keep]:
                self.remote.fs.rm(self.remote.join(step_dir(step)), recursive=True)
        except (OSError, StorageRefused) as exc:
            log.warning("could not prune old checkpoints in %s: %s", self.remote.url, exc)

    def report(self) -> None:
        if self.on_status is not None:
            with self.lock:
                snapshot = UploadStatus(list(self.status.pending), self.status.last_success,
                                        self.status.last_error, list(self.status.uploaded), self.status.last_commit,
                                        self.status.write_error, self.status.permanent_error)
            self.on_status(snapshot)

    def wait_uploads(self, timeout: float) -> bool:
        """Block until the queue is drained (True) or `timeout` passes (False); the manager's
        wait_uploads waits for the step being written first."""
        if self.thread is None:
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
