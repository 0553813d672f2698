"""PyTorch Lightning runs checkpointing through our manager: Lightning's own checkpoint file
(weights, optimizer, schedulers, loops, callbacks) is written by `trainer.save_checkpoint`, then
committed atomically with a sha256 manifest, uploaded in the background to the bucket and kept
K deep; SIGTERM (the spot notice, passed on by the entrypoint) makes every rank save at the
same step and stop; a restart resumes from the newest good checkpoint, local or in the bucket.

    import lightning.pytorch as pl
    from training.ckpt.lightning import SpotCheckpoint

    spot = SpotCheckpoint()                  # CHECKPOINT_URL, CHECKPOINT_EVERY, ... from the contract
    trainer = pl.Trainer(max_steps=1000, callbacks=[spot], enable_checkpointing=False, ...)
    raise SystemExit(spot.fit(trainer, model, datamodule=data))   # resume, train, wait for uploads

(`spot.fit` is `trainer.fit(..., ckpt_path=spot.resume())` and `spot.close()`; it does not train
a run whose checkpoint is already at `max_steps`.) Launch it with torchrun (or the stack's
entrypoint) and `strategy="ddp"`: Lightning then joins the process group torchrun describes.

Lightning's own SIGTERM handling (a broadcast inside the signal handler, then an exit without a
checkpoint) is replaced for the length of the fit by ours: the flag is combined across ranks
after each batch, so all of them save the same step. Lightning restarts an interrupted epoch's
data from the batch its own loaders allow (mid-epoch exactness needs a stateful loader).
"""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from training.ckpt.checkpointer import Interval, StopFlag, choose_checkpoint, finish, open_manager
from training.ckpt.run_control import EXIT_REFUSED, process_exit, refuse, say_refused
from training.distributed import Comm

log = logging.getLogger("gts.lightning")
CKPT_FILE = "lightning.ckpt"


def _loaders(data: dict[str, Any]) -> list[Any]:
    """The loaders in fit's data arguments (a loader, or lists / dicts of them)."""
    found: list[Any] = []
    pending = list(data.values())
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif item is not None and hasattr(item, "dataset"):
            found.append(item)
    return found


class SpotCheckpoint(pl.Callback):
    """Checkpoints of a Lightning run through the spot-safe manager (see the module docstring)."""

    def __init__(self, every: int | str | None = None, *, url: str | None = None, local_dir: str | None = None,
                 keep: int | None = None, upload_deadline_s: float = 90.0):
        self.comm = Comm("auto")  # joins the process group torchrun describes; Lightning then reuses it
        self.interval = Interval(every, self.comm)
        self.stop = StopFlag()
        self.manager = open_manager(self.comm, url, local_dir, keep, on_status=self.interval.status)
        self.deadline = upload_deadline_s
        self.last_saved = 0
        self.stopped: str | None = None
        self.refused = False  # the store refused the uploads for good
        self.resumed_step = 0

    # -- resume / fit / close ---------------------------------------------------------------
    def resume(self) -> str | None:
        """The newest checkpoint every rank can load, verified (fetched from the bucket where
        needed): the path for `trainer.fit(ckpt_path=...)`, or None."""
        found = choose_checkpoint(self.manager, self.comm, load=lambda step: (self.manager.load_folder(step), None))
        self.manager.resync()
        if found is None:
            return None
        self.resumed_step = self.last_saved = found.step
        if self.comm.rank == 0:
            log.info("resuming Lightning from checkpoint step %d", found.step)
        return str(Path(found.state) / CKPT_FILE)

    def fit(self, trainer: pl.Trainer, model: pl.LightningModule, **data: Any) -> int:
        """Resume `trainer` from the newest good checkpoint, fit `model` to max_steps or a stop
        signal, wait for the uploads. Returns the exit code (training.ckpt.checkpointer.finish)."""
        stateful = [type(x).__name__ for x in _loaders(data) if callable(getattr(x, "load_state_dict", None))]
        if stateful:
            if self.comm.rank == 0:
                refuse(f"refused: Lightning with {stateful[0]} does not resume exactly here: after a resume no step "
                       "trained on the samples an uninterrupted run trains on (issue 42). Pass a plain DataLoader "
                       "(Lightning replays the interrupted epoch from its start), or use training.ckpt.checkpointer's "
                       "Checkpointer in your own loop, which resumes both loaders exactly")
            self.manager.close(timeout=0)
            return process_exit(EXIT_REFUSED)
        path = self.resume()
        if path is not None and 0 < trainer.max_steps <= self.resumed_step:
            if self.comm.rank == 0:
                log.info("run complete: checkpoint step %d is at max_steps; nothing to train", self.resumed_step)
        else:
            options: dict[str, Any] = {}
            if "weights_only" in inspect.signature(trainer.fit).parameters:
                options["weights_only"] = True  # a checkpoint in a shared bucket must not run code when loaded
            trainer.fit(model, ckpt_path=path, **data, **options)
        return self.close()

    def close(self) -> int:
        return process_exit(finish(self.manager, self.comm, self.stop.raised, self.stopped is not None, self.deadline,
                                   self.last_saved if self.refused else None))

    # -- Callback hooks ---------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop.install()  # after Lightning's own handlers: ours decide

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        fresh = step != self.last_saved
        stopping, asked, due, refused = self.comm.any_true(
            self.stop.raised is not None, self.stop.take_checkpoint_request(),
            fresh and self.interval.due(step, self.last_saved), bool(self.manager.refused))
        if due or stopping or asked or refused:
            self.save(trainer)
        if refused:  # the bucket is gone or refuses writes: saved locally, then close() says so (exit 2)
            self.refused = True
            trainer.should_stop = True
            say_refused(self.manager, self.comm, step)
            return
        if stopping:
            self.stopped = self.stop.raised or "a signal on another rank"
            trainer.should_stop = True
            if self.comm.rank == 0:
                log.warning("stopped by %s at step %d after an emergency checkpoint", self.stopped, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save(trainer)  # the finished state: a restart finds nothing left to do

    def save(self, trainer: pl.Trainer) -> None:
        """Lightning writes its file (rank 0), then every rank commits it through the manager."""
        step = trainer.global_step
        if step == self.last_saved:
            return
        staging = self.manager.local / f".lightning-{step:08d}"
        self.interval.saving(step)
        trainer.save_checkpoint(staging / CKPT_FILE)  # every rank calls it; rank 0 writes
        if self.comm.local_rank == 0:
            staging.mkdir(parents=True, exist_ok=True)  # a node without rank 0 commits its (empty) share
        blocked = self.manager.save_folder(step, staging, self.comm.barrier)
        if self.comm.local_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self.interval.saved(blocked)
        self.last_saved = step
        if self.comm.rank == 0:
            log.info("checkpoint step %d committed (loop blocked %.3f s)", step, blocked)
