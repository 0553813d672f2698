"""Checkpoints for your own training code: the manager our trainer uses (atomic commit, a BLAKE3
digest checked on load, background upload with retries, keep-K, a lock per run), the emergency
checkpoint on SIGTERM / SIGINT / the spot notice, and exact resume, behind three lines.

    from training.ckpt.checkpointer import Checkpointer

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

Faster resume of a large model: make the Checkpointer first (the newest step is fetched while the
model is built), build the model on the meta device, name the objects with `track`, and
`resume(assign=True)` (the model takes the loaded tensors; docs/trainer-and-library.md).

Sharded state (FSDP2's `fully_shard`, or any model whose parameters are DTensors) is taken the
same way, found by itself (or `sharded=True`: a one-process run of an FSDP loop holds a plain
model, and its checkpoints must stay readable by any world size):

    fully_shard(...)                                       # your FSDP2 setup, before the optimizer
    with Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        ...                                                # the same loop

Then every rank writes its own shard through torch's distributed checkpoint (training/ckpt/sharded.py)
and `resume()` loads a checkpoint written by any number of ranks into this run's sharding; the
other objects (a scheduler) and `extra` are written once, by rank 0, as for replicated state.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from training.ckpt.manager import CheckpointError
from training.distributed import Comm
from training.loaders import LoaderState
from training.ckpt.restore import holds_dtensors, materialize, own_moments, restore_model
from training.ckpt.run_control import (EXIT_PEER_STOPPED, HistoryUnknown, Interval, Resumed, StopFlag,
                                  choose_checkpoint, exit_code, finish, open_manager, process_exit, rng_state,
                                  say_refused, say_storage, set_rng_state)
from training.ckpt.storage import StorageRefused

if TYPE_CHECKING:
    from training.ckpt.sharded import ShardedCheckpoints

log = logging.getLogger("gts.checkpointing")

# Importable from here as before (defined in training/ckpt/run_control.py).
__all__ = ["EXIT_PEER_STOPPED", "Checkpointer", "Interval", "Resumed", "Stateful", "StopFlag", "choose_checkpoint",
           "exit_code", "finish", "open_manager", "rng_state", "set_rng_state"]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


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
        self.refused = False  # the store refused the uploads for good: the run stopped (close() says why)
        self.exit_code = 0  # set when the `with` block ends (close())
        self.sharded: ShardedCheckpoints | None = None
        self._sharded_arg = sharded
        self._tracking = bool(state)
        if state:
            self._open_sharded(sharded)
        elif sharded is not True:
            # Made before the model (the fast resume): the newest step is fetched, checked and
            # loaded on a background thread while the caller builds the model; `track` then
            # names the objects and `resume` takes what was loaded.
            self.manager.prefetch()

    def track(self, **state: Stateful | DataLoader[Any]) -> Checkpointer:
        """The objects to save and restore, for a Checkpointer made before them (so that the
        newest checkpoint is fetched while they are built). Once, before `resume`."""
        if self._tracking:
            raise ValueError("Checkpointer.track: this Checkpointer already has its objects (pass them either "
                             "to the constructor or to track, once)")
        if not state:
            raise ValueError("Checkpointer.track: name the objects to checkpoint, e.g. track(model=model, "
                             "optimizer=optimizer)")
        self._tracking = True
        self.loaders = {name: LoaderState(name, obj, set_rng_state) for name, obj in state.items()
                        if isinstance(obj, DataLoader)}
        self.state = {name: obj for name, obj in state.items() if not isinstance(obj, DataLoader)}
        self._open_sharded(self._sharded_arg)
        return self

    def _open_sharded(self, sharded: bool | None) -> None:
        """The sharded path when asked for, or when the state holds DTensors (FSDP2): the one
        model and its optimizers go through DCP, every rank its shard; the rest stays as it is."""
        if sharded is None:
            # the old home's name when it is loaded: a patch of training.sharded.holds_dtensors still counts
            home = sys.modules.get("training.ckpt.sharded")
            check = getattr(home, "holds_dtensors", holds_dtensors)
            sharded = any(check(obj) for obj in self.state.values())
        if not sharded:
            return
        # Only now: a replicated loop never loads torch's distributed checkpoint.
        from training.ckpt.sharded import ShardedCheckpoints

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
        self.manager.end_prefetch()  # a sharded state is read shard by shard, not as one file

    def _plain_state(self) -> dict[str, Stateful]:
        """The objects whose state rank 0 writes whole (all of them, unless sharded)."""
        if self.sharded is None:
            return self.state
        return {name: obj for name, obj in self.state.items()
                if name != self.model_name and name not in self.optimizers}

    def resume(self, assign: bool = False) -> int:
        """Restore the newest checkpoint every rank can load (checked file by file); returns its
        step, or 0 when there is none. Committed steps the bucket lacks are uploaded now.

        `assign=True`: the models take the loaded tensors themselves instead of copying them
        into their own (no second copy of the weights in memory, none of the copy's time), and
        the optimizers are pointed at them. For models whose values the checkpoint replaces: a
        model built on the meta device (its optimizer built over it) takes them as they are;
        when there is no checkpoint it gets memory on the CPU and its modules' own initial values
        (`reset_parameters`). A model with tied parameters, or whose saved tensors differ in type
        or layout, is copied as without `assign`."""
        if not self._tracking:
            raise ValueError("Checkpointer.resume: no objects to restore; call track(model=..., optimizer=...) "
                             "first")
        try:
            step = self._resume(assign)
        finally:
            self.manager.end_prefetch()  # a prefetched step nobody chose is not held for the run
        if step == 0:  # nothing restored: a model built on the meta device gets memory and its own initial values
            optimizers = [obj for obj in self.state.values() if isinstance(obj, torch.optim.Optimizer)]
            for obj in self.state.values():
                if isinstance(obj, nn.Module) and materialize(obj, optimizers):
                    log.info("no checkpoint: the model built on the meta device was given memory on the CPU and "
                             "its modules' initial values (reset_parameters)")
        return step

    def _resume(self, assign: bool) -> int:
        try:
            found = self.sharded.choose() if self.sharded is not None else choose_checkpoint(self.manager, self.comm)
        except (StorageRefused, HistoryUnknown) as exc:  # no such bucket, access denied: exit 2; unread: a restart
            self.manager.close(timeout=0)
            raise SystemExit(process_exit(say_storage(self.comm, exc))) from None
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
        self._load_plain(plain, saved, assign)
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

    @staticmethod
    def _load_plain(plain: dict[str, Stateful], saved: dict[str, Any], assign: bool) -> None:
        """Models first (with `assign`, they take the loaded tensors and the optimizers are
        pointed at them), then everything else in the order given."""
        optimizers = [obj for obj in plain.values() if isinstance(obj, torch.optim.Optimizer)]
        done, copied = set(), False
        if assign:
            for name, obj in plain.items():
                if isinstance(obj, nn.Module):
                    if not restore_model(obj, optimizers, saved[name], empty=True):
                        copied = True
                        log.info("resume(assign=True): %s copied (tied parameters, or saved values of another "
                                 "type, layout or device)", name)
                    done.add(name)
        for name, obj in plain.items():
            if name not in done:
                obj.load_state_dict(saved[name])
        if copied:  # as the trainer does: moments in storages of their own once the weights were copied
            for opt in optimizers:
                own_moments(opt)

    def step(self, step: int, **extra: Any) -> bool:
        """After each optimizer step, with the number of steps done: saves every `every` steps,
        on SIGUSR1, and on SIGTERM / SIGINT on any rank — then returns True: leave the loop. It
        also returns True (after saving locally) once the store refused the uploads for good (the
        bucket is gone, access denied): the `with` block's exit code is then non-zero."""
        stopping, asked, due, refused = self.comm.any_true(
            self.stop.raised is not None, self.stop.take_checkpoint_request(),
            self.interval.due(step, self.last_saved), bool(self.manager.refused))
        if due or stopping or asked or refused:
            self._save(step, **extra)
        if refused:
            self.refused = True
            say_refused(self.manager, self.comm, step)
            return True
        if stopping:
            self.stopped = self.stop.raised or "a signal on another rank"
            if self.comm.rank == 0:
                log.warning("stopped by %s at step %d after an emergency checkpoint", self.stopped, step)
        return stopping

    def save(self, step: int, **extra: Any) -> float:
        """Checkpoint now and wait until it is committed on this node's disk (every rank calls
        it); returns the seconds the loop was blocked. Raises CheckpointError on every rank when
        the step could not be written (a full disk: which one, and how much the step needed), so
        that a loop's own "done" after its last save never runs on a checkpoint that is not there.
        The saves `step()` makes are written in the background and do not wait."""
        blocked = self._save(step, **extra)
        if self.sharded is not None:
            self.sharded.wait()  # this rank's shard is written
        self.manager.wait_commit()
        failures = [f for f in self.comm.all_gather_object(self.manager.write_error) if f]
        if failures:
            raise CheckpointError(f"checkpoint step {step} could not be written: {failures[0]}")
        return blocked

    def _save(self, step: int, **extra: Any) -> float:
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
        """Wait for the uploads (up to the deadline) and return the process's exit code (finish):
        non-zero when the store refused the checkpoints or the last one could not be written.
        Under the image's entrypoint a refusal is its last line and exit 2 (this returns 0 then,
        so that the launcher adds no traceback of its own)."""
        self.manager.end_prefetch()  # made before the model and never resumed: nothing is held
        if self.sharded is not None:
            self.sharded.close()  # this rank's shard of the last checkpoint is written
        return process_exit(finish(self.manager, self.comm, self.stop.raised, self.stopped is not None, self.deadline,
                                   self.last_saved if self.refused else None))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.exit_code = self.close()
