"""The newest step loaded while the caller builds its model (Loader.prefetch; issue 34's prefetch,
issue 44's fetch process).

A rank that resumes from the bucket into memory (training/ckpt/memory.py: the only rank on its
node, an s3:// oss:// or cosn:// bucket) has the step fetched by a process of its own
(training/ckpt/fetch_process.py: `prefetch`'s, started before torch was imported, or one started
now): a thread here waits for its answer and maps the files it fetched. Everywhere else, and
whenever the fetch process brings nothing (it could not start, died, the bucket holds no step,
the step goes to disk, or a step on this disk is as new), the thread lists and loads the newest
step itself, as the loader would. A fault the fetch process found in the step is not met again
here: `load` meets it and reports it as usual."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any, Protocol

from training.ckpt import fetch_process
from training.ckpt.files import Topology
from training.ckpt.memory import in_memory
from training.ckpt.storage import Location

log = logging.getLogger("gts.checkpoint")

State = tuple[dict[str, Any], dict[str, Any] | None]  # Loader.load's result: (model state, RNG state or None)


class Steps(Protocol):
    """What a prefetch needs of its loader (training/ckpt/loader.py's Loader)."""

    remote: Location | None
    topo: Topology

    def local_steps(self) -> list[int]: ...

    def loadable_steps(self) -> set[int]: ...

    def load(self, step: int) -> State: ...

    def read_memory(self, step: int, paths: dict[str, Path], how: str = "") -> State: ...


class Prefetch:
    """One loader's prefetch: `start` once, `take` the step the caller chose, `end` when it
    resumed (what nobody took is dropped, a fetch under way stopped), `wait` before closing."""

    def __init__(self, loader: Steps):
        self.loader = loader
        self.thread: threading.Thread | None = None
        self.fetcher: fetch_process.FetchProcess | None = None
        self.found: tuple[int, State] | None = None
        self.ended = False
        self._listing: dict[str, Any] | None = None  # the fetch process's listing, until `listing` takes it
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.thread is not None:
            return
        remote = self.loader.remote
        if remote is not None and remote.remote and in_memory(self.loader.topo):
            self.fetcher = fetch_process.take(remote.url, dataclasses.asdict(self.loader.topo))
        else:
            fetch_process.drop()  # one `prefetch` started would fetch what this rank does not load into memory
        self.thread = threading.Thread(target=self._run, name="checkpoint-prefetch", daemon=True)
        self.thread.start()

    def end(self) -> None:
        with self._lock:
            self.ended, self.found, self._listing = True, None, None
            fetcher = self.fetcher
        if fetcher is not None:
            fetcher.stop()
        fetch_process.drop()  # one `prefetch` started that this loader never took

    def listing(self) -> dict[str, Any] | None:
        """The bucket's steps as the fetch process listed them ({"steps", "error", "told"}: the
        loader's remote_steps), once, after waiting for the prefetch, when its step was mapped;
        else None (the loader lists the bucket itself). The listing is as of the fetch's start,
        a few seconds before: another run cannot write there since (global rank 0's lease, taken
        by the process before it listed, or by the manager; a run refused it exits), but a process
        of the same run still stopping (a pod replaced while it ends) may commit a step after it:
        this resume does not see that step, as a listing made just before a commit never did."""
        thread = self.thread
        if self.fetcher is None or thread is None or threading.current_thread() is thread:
            return None
        thread.join()
        with self._lock:
            listing, self._listing = self._listing, None
        return listing

    def take(self, step: int) -> State | None:
        """The prefetched state if it is `step`'s (after waiting for the prefetch), else None."""
        thread = self.thread
        if thread is None or threading.current_thread() is thread:
            return None
        thread.join()
        with self._lock:
            found, self.found = self.found, None
        return found[1] if found is not None and found[0] == step else None

    def wait(self) -> None:
        """Until the prefetch has finished; a fetch process still running is stopped first (it
        writes nothing to disk, and a store that does not answer would hold the close)."""
        with self._lock:
            self.ended = True  # nothing is fetched on the thread instead of the process stopped here
        if self.fetcher is not None:
            self.fetcher.stop()
        if self.thread is not None:
            self.thread.join()

    def _keep(self, found: tuple[int, State]) -> None:
        with self._lock:
            if not self.ended:
                self.found = found

    def _run(self) -> None:
        try:
            if self.fetcher is not None and self._from_process(self.fetcher):
                return
            if self.ended:
                return
            steps = sorted(self.loader.loadable_steps())
            if steps:
                self._keep((steps[-1], self.loader.load(steps[-1])))
        except Exception as exc:  # noqa: BLE001 (load, on the caller's thread, meets it again and says so)
            log.debug("prefetch: %s", exc)

    def _from_process(self, fetcher: fetch_process.FetchProcess) -> bool:
        """Whether the fetch process's answer settles the prefetch: its step mapped, or a fault
        it found in the step (left to `load`). False: the thread lists and loads itself."""
        try:
            fetched = fetcher.answer()
            if fetched.fault:
                log.debug("prefetch: fetch process %d: %s", fetcher.pid, fetched.why)
                return True
            local = self.loader.local_steps()
            why = (fetched.why or "nothing fetched") if not fetched.paths or fetched.step is None else (
                f"step {local[-1]} is on this disk" if local and local[-1] >= fetched.step else "")
            if why or fetched.step is None:
                log.debug("prefetch: fetch process %d brought nothing used (%s)", fetcher.pid, why)
                return False
            if self.ended:  # resumed meanwhile from elsewhere: nothing to map
                return True
            step = fetched.step
            self._keep((step, self.loader.read_memory(step, fetched.paths, f", by fetch process {fetcher.pid}")))
            with self._lock:
                self._listing = dict(fetched.listing) if fetched.listing and not self.ended else None
            return True
        finally:
            fetcher.close()
