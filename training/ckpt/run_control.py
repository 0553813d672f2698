"""What every way of running our checkpoints shares (the trainer, the Checkpointer library, the
Hugging Face and Lightning callbacks): the stop flag the signal handlers set, the RNG state
saved per rank, choosing the newest step every rank can load, when to checkpoint (every N
steps or auto), opening the manager from the trainer contract, and the exit code at the end."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from training import contract, reservation
from training.ckpt.manager import CheckpointError, CheckpointManager, RunLocked, Topology, UploadStatus
from training.distributed import Comm
from training.goodput import AutoInterval
from training.ckpt.storage import StorageRefused, StorageUnavailable

log = logging.getLogger("gts.checkpointing")

# A rank that stopped because another node was told to (its spot notice): non-zero, so torchrun's
# agent restarts the workers and re-rendezvouses with the nodes that remain (EX_TEMPFAIL).
EXIT_PEER_STOPPED = 75
# A refusal the user must act on (the store refused the checkpoints, the run's lock, changed settings).
EXIT_REFUSED = 2
# The run's history could not be read (the bucket did not answer): every rank exits with it, and
# torchrun's agent (then systemd, once its restarts are spent) starts the workers again (EX_TEMPFAIL).
EXIT_RETRY = 75
LOAD_ATTEMPTS = 4  # a step's load that meets a store not answering: tries, then EXIT_RETRY
LOAD_WAIT_S = (2.0, 20.0)  # the first wait between them, and the longest


def refuse(message: str) -> None:
    """A refusal the user must act on: logged, and written where the entrypoint asked
    (GTS_REFUSAL_FILE), which repeats it as its own last line (and exits 2) instead of the
    launcher's traceback of a failed worker."""
    log.error("%s", message)
    path = os.environ.get("GTS_REFUSAL_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(message.replace("\n", " ") + "\n")


def process_exit(code: int) -> int:
    """The code a worker exits with: a refusal the entrypoint repeats (GTS_REFUSAL_FILE) exits 0,
    so that the launcher stays quiet and the entrypoint's last line is the refusal (exit 2)."""
    return 0 if code == EXIT_REFUSED and os.environ.get("GTS_REFUSAL_FILE") else code


class StopFlag:
    """Signal handlers only set flags; the loop combines them across ranks after each step.
    SIGTERM / SIGINT: checkpoint and stop. SIGUSR1 (a rebalance recommendation, or a person):
    checkpoint now and go on."""

    def __init__(self, upload_s: float = 0.0) -> None:
        self.raised: str | None = None
        self.checkpoint_requested = False
        # the end of the nodes' reservation (RESERVATION_END): stop, like a signal, in time for the upload
        self.reservation = reservation.Deadline.from_env(dict(os.environ), upload_s)
        self.install()

    def poll(self) -> str | None:
        """Why the run must stop now, if it must: a signal, or its reservation's end coming."""
        if self.raised is None and self.reservation.due():
            self.raised = reservation.REASON
        return self.raised

    def install(self) -> None:
        """(Again) make these handlers the process's: after a framework installed its own."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        signal.signal(signal.SIGUSR1, self._checkpoint)

    def _handle(self, signum: int, frame: Any) -> None:
        self.raised = signal.Signals(signum).name

    def _checkpoint(self, signum: int, frame: Any) -> None:
        self.checkpoint_requested = True

    def take_checkpoint_request(self) -> bool:
        asked, self.checkpoint_requested = self.checkpoint_requested, False
        return asked


def rng_state() -> dict[str, Any]:
    """Every RNG the step uses, as tensors and plain values only: checkpoints are read with
    torch.load(weights_only=True), which refuses anything that could run code (a numpy array in
    a pickle included)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    saved = state["numpy"]
    np.random.set_state((saved["name"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                         saved["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class HistoryAtRisk(StorageRefused):
    """The bucket holds committed steps of this run but none can be restored: the run stops
    (exit 2, as for a refused store) instead of starting again from step 0 over them."""


class HistoryUnknown(Exception):
    """No step could be restored and the bucket could not be read whole (its listing or a listed
    step's manifest failed on some rank): it may hold steps, so the run must not start from step 0
    (it would upload over them, and pruning would then delete them). Every rank exits EXIT_RETRY."""


def say_storage(comm: Comm, exc: StorageRefused | HistoryUnknown) -> int:
    """One line (rank 0) for a refused store (exit 2: refuse()) or HistoryUnknown (EXIT_RETRY, on
    every rank: a restart); the code the ranks return."""
    if isinstance(exc, HistoryUnknown):
        if comm.rank == 0:
            log.error("stopped before step 1: %s; exiting %d so that the run is started again", exc, EXIT_RETRY)
        return EXIT_RETRY
    if comm.local_rank == 0:  # every node's entrypoint repeats it and exits 2 (not 0: a node restarted over it)
        refuse(f"refused: checkpoint storage {exc}")
    return EXIT_REFUSED


@dataclass
class Resumed:
    step: int
    state: Any
    rng: dict[str, Any] | None
    # the newest step at or before `step` that every rank holds on disk or in the bucket (0: none):
    # `step` itself unless it came from the peer tier, whose copies are never durable
    durable: int = 0


def choose_checkpoint(ckpt: CheckpointManager, comm: Comm,
                      load: Callable[[int], tuple[Any, dict[str, Any] | None]] | None = None,
                      extra: set[int] | None = None,
                      first: Callable[[int], tuple[Any, dict[str, Any] | None] | None] | None = None
                      ) -> Resumed | None:
    """The newest step every rank can load, each file checked; a step that fails on any rank is
    skipped with a log line naming the rank, file and fault, and the one before it is tried.
    `load` reads one step (default: the model state and this rank's RNG state); `extra`: steps
    this rank can get elsewhere too (the peer tier's, training/ckpt/peer/tier.py); `first`: a
    collective reader of those (None on every rank alike when it has not the step), tried once
    before `load`. It is never inside `load`'s retries: a rank retrying a bucket that blipped
    would enter its collectives while the other ranks are in the next one (issue 46)."""
    load = load or ckpt.load
    local, remote = set(ckpt.local_steps()), set(ckpt.remote_steps())
    listed = comm.all_gather_object((sorted(local | remote | (extra or set())), sorted(remote), ckpt.remote_error,
                                     sorted(local | remote)))
    common = set.intersection(*(set(mine) for mine, _, _, _ in listed))
    in_bucket = sorted(set().union(*(set(theirs) for _, theirs, _, _ in listed)))
    unread = next((why for _, _, why, _ in listed if why), "")
    durable = set.intersection(*(set(kept) for _, _, _, kept in listed))
    if ckpt.remote_error and comm.local_rank == 0:
        log.warning("the bucket %s cannot be listed (%s): starting from this node's own checkpoints; uploads "
                    "are retried in the background", ckpt.remote.url if ckpt.remote else "", ckpt.remote_error)
    for step in sorted(common, reverse=True):
        found = first(step) if first is not None else None
        state, rng, fault, down = (*found, "", False) if found is not None else _load_step(load, step)
        gathered = comm.all_gather_object((fault, down))
        faults = [(rank, f) for rank, (f, _) in enumerate(gathered) if f]
        if not faults:
            return Resumed(step, state, rng, max((s for s in durable if s <= step), default=0))
        unavailable = [f for f, was_down in gathered if was_down]
        if unavailable:  # no fault of the step's: skipping it (or starting over) would lose work to a blip
            raise HistoryUnknown(f"checkpoint step {step} could not be read after {LOAD_ATTEMPTS} tries: "
                                 f"{unavailable[0]}")
        if comm.rank == 0:
            rank, said = faults[0]
            log.warning("skipping checkpoint step %d: rank %d: %s%s", step, rank, said,
                        f" (and {len(faults) - 1} more rank(s))" if len(faults) > 1 else "")
    if unread:  # the bucket may hold steps no rank could see: starting from nothing would write over them
        raise HistoryUnknown(f"{ckpt.remote.url if ckpt.remote else ''} could not be read ({unread}) and no step "
                             "every rank can load was found: starting from step 0 could write over the run's history")
    if in_bucket:  # starting from nothing would write new steps over the run's history there
        raise HistoryAtRisk(f"{ckpt.remote.url if ckpt.remote else ''}: holds committed steps {in_bucket} but no "
                            "step every rank can load (the lines above say why): starting from step 0 would write "
                            "over them; fix what the lines above name, or give this run a new checkpoint URL")
    if common and comm.rank == 0:
        log.warning("no usable checkpoint among steps %s: starting from scratch", sorted(common))
    return None


def _load_step(load: Callable[[int], tuple[Any, dict[str, Any] | None]], step: int
               ) -> tuple[Any, dict[str, Any] | None, str, bool]:
    """(state, rng, fault, unavailable) of `step`: a fault of the step's own (digest, size, manifest:
    CheckpointError) at once; a store that does not answer (StorageUnavailable) after
    LOAD_ATTEMPTS tries, LOAD_WAIT_S apart and doubling."""
    try:
        for attempt in Retrying(stop=stop_after_attempt(LOAD_ATTEMPTS), reraise=True,
                                wait=wait_exponential(multiplier=LOAD_WAIT_S[0], max=LOAD_WAIT_S[1]),
                                retry=retry_if_exception_type(StorageUnavailable)):
            with attempt:
                state, rng = load(step)
        return state, rng, "", False
    except CheckpointError as exc:
        return {}, None, str(exc), False
    except StorageUnavailable as exc:
        return {}, None, str(exc), True


def exit_code(comm: Comm, raised: str | None) -> int:
    """After an emergency checkpoint: 0 where a node was told to stop; 75 on the other nodes of
    a multi-node run, whose agents then go on without it."""
    if comm.nnodes > 1:
        signalled = {node for node, signal_name in comm.all_gather_object((comm.node, raised)) if signal_name}
        if comm.node not in signalled:
            return EXIT_PEER_STOPPED
    return 0


def _setting(value: Any, var: contract.Var, default: Any) -> Any:
    """An argument, else the contract's environment variable, else the default."""
    if value is not None:
        return value
    raw = os.environ.get(var.name, "")
    if not raw:
        return default
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"{var.name}={raw!r}: expected {type(default).__name__}") from None


class Interval:
    """When to checkpoint, the same in our trainer, the library and the Hugging Face callback:
    every N steps, or `auto` (CHECKPOINT_EVERY=auto: Daly's interval from the measured
    loop-blocked time, step time and time until a checkpoint is in the bucket, and MTBF_S /
    NOTICE_S; training/goodput.py). Rank 0 decides; the caller combines the flag across ranks
    in its per-step collective. `status` is the manager's on_status callback."""

    def __init__(self, every: int | str | None, comm: Comm, mtbf_s: float | None = None,
                 notice_s: float | None = None):
        raw = every if every is not None else (os.environ.get(contract.CHECKPOINT_EVERY.name) or 500)
        self.comm = comm
        self.auto: AutoInterval | None = None
        self.every = 0
        self.last_step_at: float | None = None
        self.started: dict[int, float] = {}  # step -> when its save began
        if str(raw) == "auto":
            self.auto = AutoInterval(_setting(mtbf_s, contract.MTBF_S, 0.0), _setting(notice_s, contract.NOTICE_S, 0.0),
                                     log.info)
        else:
            try:
                self.every = int(raw)
            except ValueError:
                raise ValueError(f"{contract.CHECKPOINT_EVERY.name}={raw!r}: a whole number of steps or auto") from None
            if self.every <= 0:
                raise ValueError(f"checkpoint interval {self.every}: must be a positive number of steps")

    @property
    def steps(self) -> int | None:
        """Steps between checkpoints now (None until auto has measured a step)."""
        return self.every if self.auto is None else self.auto.steps

    def due(self, step: int, last_saved: int) -> bool:
        """This rank's view after optimizer step `step` (wall time between calls is the step time)."""
        if self.auto is None:
            return step % self.every == 0
        now = time.perf_counter()
        if self.last_step_at is not None:
            self.auto.observe_step(now - self.last_step_at)
        self.last_step_at = now
        return self.comm.rank == 0 and self.auto.due(step - max(last_saved, 0))

    def saving(self, step: int) -> None:
        self.started[step] = time.time()

    def saved(self, blocked_s: float) -> None:
        if self.auto is not None:
            self.auto.observe_checkpoint(blocked_s)
            self.last_step_at = None  # the checkpoint is not a step

    def status(self, status: UploadStatus) -> None:
        """The manager's report: the newest upload tells how long a checkpoint takes to be durable."""
        if self.auto is not None and status.uploaded and status.uploaded[-1] in self.started:
            self.auto.observe_durable(status.last_success - self.started.pop(status.uploaded[-1]))


def finish(manager: CheckpointManager, comm: Comm, raised: str | None, stopped: bool, deadline: float,
           step: int | None = None) -> int:
    """Wait for the uploads (up to `deadline` s) and return the process's exit code: 0; 2 (a
    refusal: refuse()) when the store refused the checkpoints (no such bucket, access denied);
    1 when the run's last checkpoint (or the stop's own) could not be written; 75 on the nodes
    of a multi-node run that stopped because another node was told to. `step`: where the run
    is, for the messages. The trainer, the library, the Hugging Face and Lightning callbacks all
    end here (callers exit with process_exit(code))."""
    status = manager.close(timeout=deadline)
    at = f" at step {step}" if step is not None else ""
    if status.permanent_error:
        kept = [p.name for p in sorted(manager.local.glob("step-*")) if not p.name.endswith(".tmp")]
        taken = manager.lease is not None and bool(manager.lease.lost)  # another run holds the prefix now
        advice = ("give this run another checkpoint URL" if taken
                  else "fix the bucket (or copy them there), then start the run again")
        refuse(f"stopped: checkpoint storage {status.permanent_error}: the run stopped{at}; its checkpoints are kept on "
               f"this node in {manager.local} ({', '.join(kept) or 'none'}), not in the bucket: {advice}")
        return EXIT_REFUSED
    if status.pending and comm.rank == 0:
        log.error("%d checkpoint(s) not uploaded yet; kept on local disk in %s", len(status.pending), manager.local)
    if status.write_error:  # the run's last state is not on disk: a restart repeats work
        what = "the emergency checkpoint" if stopped else "its checkpoint"
        log.error("the run %s%s, but %s could not be written (%s): a restart resumes from the newest committed one",
                  "stopped" if stopped else "reached its end", at, what, status.write_error)
        return 1
    return exit_code(comm, raised) if stopped else 0


def say_refused(manager: CheckpointManager, comm: Comm, step: int) -> None:
    """The loop learnt (in its per-step collective, from `manager.refused` on any rank) that the
    store refused the uploads for good (the bucket is gone, the credentials lost the right): it
    saves this step locally and leaves; finish() then names the URL, the cause and the folder."""
    if comm.rank == 0:
        log.error("checkpoint storage refused the uploads (%s): stopping at step %d", manager.refused or "on another node",
                  step)


def open_manager(comm: Comm, url: str | None, local_dir: str | None, keep: int | None,
                 on_status: Callable[[UploadStatus], None] | None = None) -> CheckpointManager:
    """The run's checkpoint manager, configured from the arguments or the trainer contract."""
    remote = _setting(url, contract.CHECKPOINT_URL, "")
    folder = _setting(local_dir, contract.CHECKPOINT_DIR, "out/checkpoints")
    if "://" in folder and not folder.startswith("file://"):
        folder, remote = "out/checkpoint-cache", folder
    topo = Topology(comm.rank, comm.local_rank, comm.world, comm.node, comm.nnodes, comm.local_world)
    manager: CheckpointManager | None = None
    try:
        manager = CheckpointManager(folder.removeprefix("file://"), remote or None, topo,
                                    keep=_setting(keep, contract.KEEP_CHECKPOINTS, 3), on_status=on_status)
    except RunLocked as exc:  # this node's folder, or the bucket's prefix (training/ckpt/lease.py), is another run's
        refuse(f"refused: {exc}")
    (locked,) = comm.any_true(manager is None)
    if manager is None or locked:
        if manager is not None:
            manager.close(timeout=0)  # gives back a lease this rank took
        raise SystemExit(process_exit(EXIT_REFUSED))  # every rank: one line, no traceback
    return manager
