"""Checkpoints for your own training code: the manager our trainer uses (atomic commit, sha256
checked on load, background upload with retries, keep-K, a lock per run), the emergency
checkpoint on SIGTERM / SIGINT / the spot notice, and exact resume, behind three lines.

    from training.checkpointing import Checkpointer

    with Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        for step in range(ckpt.resume(), total_steps):     # the newest good checkpoint, or 0
            train_one_step(step)
            if ckpt.step(step + 1):                        # every CHECKPOINT_EVERY steps, and on
                break                                      # a stop signal: saved, now leave

Where the checkpoints go comes from the trainer contract the stack gives every node and Job
(CHECKPOINT_URL, CHECKPOINT_DIR, CHECKPOINT_EVERY, KEEP_CHECKPOINTS; training/contract.py), or
from the arguments. Under torchrun or `accelerate launch` every rank makes a Checkpointer and
calls `step` after each optimizer step: the ranks agree on when to save and stop (one
collective per step), each rank's RNG streams are saved and restored, and the objects' state is
written once per node. Anything with `state_dict()` / `load_state_dict()` can be passed; other
values that shape the run (an epoch counter, a data position) go into `step(..., **extra)` and
come back in `ckpt.extra` after `resume()`.

Exact resume with a DataLoader: pass it like the model (`loader=loader`) and start the epoch
loop at `ckpt.epoch` (training/loaders.py keeps its position and randomness per rank; torchdata's
StatefulDataLoader is taken too). Without a loader, make the data order a function of the step
(or of values kept in `extra`).
The checkpoints are read with weights_only: tensors and plain values only.

Sharded state (FSDP2's `fully_shard`, or any model whose parameters are DTensors) is taken the
same way, found by itself (or `sharded=True`: a one-process run of an FSDP loop holds a plain
model, and its checkpoints must stay readable by any world size):

    fully_shard(...)                                       # your FSDP2 setup, before the optimizer
    with Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        ...                                                # the same loop

Then every rank writes its own shard through torch's distributed checkpoint (training/sharded.py)
and `resume()` loads a checkpoint written by any number of ranks into this run's sharding; the
other objects (a scheduler) and `extra` are written once, by rank 0, as for replicated state.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from training import contract
from training.checkpoint import CheckpointError, CheckpointManager, Topology, UploadStatus
from training.distributed import Comm
from training.goodput import AutoInterval
from training.loaders import LoaderState

if TYPE_CHECKING:
    from training.sharded import ShardedCheckpoints

log = logging.getLogger("gts.checkpointing")

# A rank that stopped because another node was told to (its spot notice): non-zero, so torchrun's
# agent restarts the workers and re-rendezvouses with the nodes that remain (EX_TEMPFAIL).
EXIT_PEER_STOPPED = 75


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class StopFlag:
    """Signal handlers only set flags; the loop combines them across ranks after each step.
    SIGTERM / SIGINT: checkpoint and stop. SIGUSR1 (a rebalance recommendation, or a person):
    checkpoint now and go on."""

    def __init__(self) -> None:
        self.raised: str | None = None
        self.checkpoint_requested = False
        self.install()

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


@dataclass
class Resumed:
    step: int
    state: Any
    rng: dict[str, Any] | None


def choose_checkpoint(ckpt: CheckpointManager, comm: Comm,
                      load: Callable[[int], tuple[Any, dict[str, Any] | None]] | None = None) -> Resumed | None:
    """The newest step every rank can load, each file checked; a step that fails on any rank is
    skipped with a log line naming the rank, file and fault, and the one before it is tried.
    `load` reads one step (default: the model state and this rank's RNG state)."""
    load = load or ckpt.load
    common = set.intersection(*map(set, comm.all_gather_object(sorted(ckpt.loadable_steps()))))
    if ckpt.remote_error and comm.local_rank == 0:
        log.warning("the bucket %s cannot be listed (%s): starting from this node's own checkpoints; uploads "
                    "are retried in the background", ckpt.remote.url if ckpt.remote else "", ckpt.remote_error)
    for step in sorted(common, reverse=True):
        state: Any = {}
        rng = None
        try:
            state, rng = load(step)
            fault = ""
        except CheckpointError as exc:
            fault = str(exc)
        faults = [(rank, f) for rank, f in enumerate(comm.all_gather_object(fault)) if f]
        if not faults:
            return Resumed(step, state, rng)
        if comm.rank == 0:
            rank, first = faults[0]
            log.warning("skipping checkpoint step %d: rank %d: %s%s", step, rank, first,
                        f" (and {len(faults) - 1} more rank(s))" if len(faults) > 1 else "")
    if common and comm.rank == 0:
        log.warning("no usable checkpoint among steps %s: starting from scratch", sorted(common))
    return None


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
    """Wait for the uploads (up to `deadline` s) and return the process's exit code: 0, 1 when
    the run's last checkpoint (or the stop's own) could not be written or uploads are refused,
    75 on the nodes of a multi-node run that stopped because another node was told to. `step`:
    where the run is, for the messages. The trainer, the library, the Hugging Face and Lightning
    callbacks all end here."""
    status = manager.close(timeout=deadline)
    at = f" at step {step}" if step is not None else ""
    if status.pending and comm.rank == 0:
        log.error("%d checkpoint(s) not uploaded yet; kept on local disk in %s", len(status.pending), manager.local)
    if status.permanent_error:
        log.error("checkpoints could not be uploaded: %s; they are kept in %s", status.permanent_error, manager.local)
        return 1
    if status.write_error:  # the run's last state is not on disk: a restart repeats work
        what = "the emergency checkpoint" if stopped else "its checkpoint"
        log.error("the run %s%s, but %s could not be written (%s): a restart resumes from the newest committed one",
                  "stopped" if stopped else "reached its end", at, what, status.write_error)
        return 1
    return exit_code(comm, raised) if stopped else 0


def open_manager(comm: Comm, url: str | None, local_dir: str | None, keep: int | None,
                 on_status: Callable[[UploadStatus], None] | None = None) -> CheckpointManager:
    """The run's checkpoint manager, configured from the arguments or the trainer contract."""
    remote = _setting(url, contract.CHECKPOINT_URL, "")
    folder = _setting(local_dir, contract.CHECKPOINT_DIR, "out/checkpoints")
    if "://" in folder and not folder.startswith("file://"):
        folder, remote = "out/checkpoint-cache", folder
    topo = Topology(comm.rank, comm.local_rank, comm.world, comm.node, comm.nnodes, comm.local_world)
    return CheckpointManager(folder.removeprefix("file://"), remote or None, topo,
                             keep=_setting(keep, contract.KEEP_CHECKPOINTS, 3), on_status=on_status)


class Checkpointer:
    """save / resume / stop for a training loop we did not write. See the module docstring."""

    def __init__(self, every: int | str | None = None, *, url: str | None = None, local_dir: str | None = None,
                 keep: int | None = None, upload_deadline_s: float = 90.0, launcher: str = "auto",
                 sharded: bool | None = None, **state: Stateful | DataLoader[Any]):
        self.comm = Comm(launcher)
        self.interval = Interval(every, self.comm)
        self.stop = StopFlag()
        # DataLoaders are per-rank state (position, seed): they go into each rank's own file.
        self.loaders = {name: LoaderState(name, obj, set_rng_state) for name, obj in state.items()
                        if isinstance(obj, DataLoader)}
        self.state: dict[str, Stateful] = {name: obj for name, obj in state.items() if not isinstance(obj, DataLoader)}
        self.extra: dict[str, Any] = {}
        self.deadline = upload_deadline_s
        self.manager = open_manager(self.comm, url, local_dir, keep, on_status=self.interval.status)
        self.last_saved = -1
        self.stopped: str | None = None
        self.exit_code = 0  # set when the `with` block ends (close())
        self.sharded: ShardedCheckpoints | None = None
        self._open_sharded(sharded)

    def _open_sharded(self, sharded: bool | None) -> None:
        """The sharded path when asked for, or when the state holds DTensors (FSDP2): the one
        model and its optimizers go through DCP, every rank its shard; the rest stays as it is."""
        from training.sharded import ShardedCheckpoints, holds_dtensors

        if sharded is None:
            sharded = any(holds_dtensors(obj) for obj in self.state.values())
        if not sharded:
            return
        models = [name for name, obj in self.state.items() if isinstance(obj, nn.Module)]
        if len(models) != 1:
            raise ValueError(f"sharded state: pass exactly one model (an nn.Module, fully_shard-ed) to the "
                             f"Checkpointer; got {len(models)} ({', '.join(models) or 'none'})")
        self.model_name = models[0]
        model = self.state[self.model_name]
        assert isinstance(model, nn.Module)
        self.model: nn.Module = model
        self.optimizers = {name: obj for name, obj in self.state.items() if isinstance(obj, torch.optim.Optimizer)}
        self.sharded = ShardedCheckpoints(self.manager, self.comm)

    def _plain_state(self) -> dict[str, Stateful]:
        """The objects whose state rank 0 writes whole (all of them, unless sharded)."""
        if self.sharded is None:
            return self.state
        return {name: obj for name, obj in self.state.items()
                if name != self.model_name and name not in self.optimizers}

    def resume(self) -> int:
        """Restore the newest checkpoint every rank can load (checked file by file); returns its
        step, or 0 when there is none. Committed steps the bucket lacks are uploaded now."""
        found = self.sharded.choose() if self.sharded is not None else choose_checkpoint(self.manager, self.comm)
        self.manager.resync()
        if found is None:
            return 0
        saved = found.state.get("state", {})
        plain = self._plain_state()
        missing = sorted(set(plain) - set(saved))
        if missing:
            raise CheckpointError(f"checkpoint step {found.step} holds no state for {', '.join(missing)} "
                                  f"(it has {', '.join(sorted(saved)) or 'none'})")
        if self.sharded is not None:  # every rank reads the pieces of its own shard, whatever the saved world size
            self.sharded.restore(found.step, self.model, list(self.optimizers.values()))
            if self.comm.rank == 0:
                log.info("restored sharded step %d saved by %d ranks into %d", found.step,
                         int(found.state.get("world_size", 0)), self.comm.world)
        for name, obj in plain.items():
            obj.load_state_dict(saved[name])
        self.extra = dict(found.state.get("extra", {}))
        if found.rng is not None:
            set_rng_state(found.rng)
            saved_loaders = found.rng.get("loaders", {})
            for name, loader in self.loaders.items():
                if name in saved_loaders:
                    loader.load_state_dict(saved_loaders[name], found.rng)
                elif self.comm.rank == 0:
                    log.warning("checkpoint step %d holds no position for loader %r: it starts its epoch over",
                                found.step, name)
        elif self.comm.rank == 0:
            log.warning("world size changed since step %d: per-rank RNG streams and loader positions not restored",
                        found.step)
        self.last_saved = found.step
        if self.comm.rank == 0:
            log.info("resumed from checkpoint step %d", found.step)
        return found.step

    def step(self, step: int, **extra: Any) -> bool:
        """After each optimizer step, with the number of steps done: saves every `every` steps,
        on SIGUSR1, and on SIGTERM / SIGINT on any rank — then returns True: leave the loop."""
        stopping, asked, due = self.comm.any_true(self.stop.raised is not None, self.stop.take_checkpoint_request(),
                                                  self.interval.due(step, self.last_saved))
        if due or stopping or asked:
            self.save(step, **extra)
        if stopping:
            self.stopped = self.stop.raised or "a signal on another rank"
            if self.comm.rank == 0:
                log.warning("stopped by %s at step %d after an emergency checkpoint", self.stopped, step)
        return stopping

    def save(self, step: int, **extra: Any) -> float:
        """Checkpoint now (every rank calls it); returns the seconds the loop was blocked."""
        if step == self.last_saved:
            return 0.0
        payload = None
        if self.comm.local_rank == 0 or self.sharded is not None:
            payload = {"state": {name: obj.state_dict() for name, obj in self._plain_state().items()}, "extra": extra,
                       "step": step, "world_size": self.comm.world}
        self.interval.saving(step)
        per_rank = {**rng_state(), "loaders": {name: loader.state_dict() for name, loader in self.loaders.items()}}
        if self.sharded is not None:
            assert payload is not None
            blocked = self.sharded.save(step, self.model, list(self.optimizers.values()), payload,
                                        per_rank)
        else:
            blocked = self.manager.save(step, payload, per_rank, self.comm.barrier)
        self.interval.saved(blocked)
        self.last_saved = step
        self.extra = dict(extra)
        return blocked

    @property
    def epoch(self) -> int:
        """The epoch the (first) DataLoader passed in was in at the restored checkpoint (0 without
        one): start the epoch loop there."""
        return next(iter(self.loaders.values())).epoch if self.loaders else 0

    def close(self) -> int:
        """Wait for the uploads (up to the deadline) and return the process's exit code (finish)."""
        if self.sharded is not None:
            self.sharded.close()  # this rank's shard of the last checkpoint is written
        return finish(self.manager, self.comm, self.stop.raised, self.stopped is not None, self.deadline)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.exit_code = self.close()
