"""Hugging Face `transformers.Trainer` (and `accelerate launch`) runs checkpointing through our
manager: the Trainer's own checkpoint folder (weights, optimizer, scheduler, RNG per process,
trainer state) is committed atomically with a sha256 manifest, uploaded in the background to the
bucket, kept K deep; a SIGTERM (the spot notice) makes the Trainer save at the step it is on and
stop; a restart resumes from the newest good checkpoint, local or in the bucket.

    from training.ckpt.hf import SpotCheckpointCallback

    spot = SpotCheckpointCallback()                      # CHECKPOINT_URL etc. from the contract
    trainer = Trainer(model, args, train_dataset=..., callbacks=[spot])
    raise SystemExit(spot.train(trainer))                # resume, train, wait for the uploads

(`spot.train(trainer)` is `trainer.train(resume_from_checkpoint=spot.resume())` and
`spot.close()`, and it does not train a run whose checkpoint is already at `max_steps`.)

Every CHECKPOINT_EVERY steps the callback asks the Trainer to save (its own `save_steps` may be
left off: `save_strategy="no"`). Resume is the Trainer's own: it restores the optimizer, the
schedule, each process's RNG state and skips the batches already seen.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from training.ckpt.checkpointer import Interval, StopFlag, choose_checkpoint, finish, open_manager
from training.ckpt.run_control import process_exit, say_refused
from training.distributed import Comm

log = logging.getLogger("gts.hf")


class SpotCheckpointCallback(TrainerCallback):
    """Checkpoints of a `transformers.Trainer` run through the spot-safe manager."""

    def __init__(self, every: int | str | None = None, *, url: str | None = None, local_dir: str | None = None,
                 keep: int | None = None, upload_deadline_s: float = 90.0):
        self.comm = Comm("auto")  # joins the process group accelerate / torchrun describe
        self.interval = Interval(every, self.comm)  # N steps, or auto (CHECKPOINT_EVERY=auto)
        self.last_saved = 0
        self.stop = StopFlag()
        self.manager = open_manager(self.comm, url, local_dir, keep, on_status=self.interval.status)
        self.deadline = upload_deadline_s
        self.stopped: str | None = None
        self.refused = False  # the store refused the uploads for good
        self.resumed_step = 0
        self.done = False  # the run was complete before this start

    def resume(self) -> str | None:
        """The newest checkpoint every process can load, verified, as a local folder for
        `trainer.train(resume_from_checkpoint=...)`; None when there is none."""
        found = choose_checkpoint(self.manager, self.comm, load=lambda step: (self.manager.load_folder(step), None))
        self.manager.resync()
        if found is None:
            return None
        self.resumed_step = found.step
        if self.comm.rank == 0:
            log.info("resuming the Trainer from checkpoint step %d", found.step)
        return str(found.state)

    def train(self, trainer: Any) -> int:
        """Resume `trainer` from the newest good checkpoint and train it to the end or to a stop
        signal; then wait for the uploads. Returns the exit code (see close)."""
        checkpoint = self.resume()
        if checkpoint is not None and 0 < trainer.args.max_steps <= self.resumed_step:
            if self.comm.rank == 0:
                log.info("run complete: checkpoint step %d is at max_steps; nothing to train", self.resumed_step)
            self.done = True
        else:
            trainer.train(resume_from_checkpoint=checkpoint)
        return self.close()

    # -- TrainerCallback hooks -----------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> TrainerControl:
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and self.comm.rank == 0:
            from accelerate.state import AcceleratorState  # type: ignore[import-untyped]

            kind = AcceleratorState().distributed_type
            if kind.value != "FSDP":
                # accelerate (1.15) makes FSDP only on GPU-type devices; on CPU it runs DDP and says nothing.
                log.warning("FSDP was asked for (accelerate launch --use_fsdp) but accelerate runs this as %s: every "
                            "process holds the whole model and optimizer, and the checkpoints are replicated ones. "
                            "accelerate builds FSDP only on GPUs (and other accelerators), not on CPU", kind.value)
        return control

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        stopping, asked, due, refused = self.comm.any_true(
            self.stop.raised is not None, self.stop.take_checkpoint_request(),
            self.interval.due(state.global_step, self.last_saved), bool(self.manager.refused))
        if due or stopping or asked or refused or state.global_step >= state.max_steps:
            control.should_save = True
        if refused:  # the bucket is gone or refuses writes: saved locally, then close() says so (exit 2)
            self.refused = True
            control.should_training_stop = True
            say_refused(self.manager, self.comm, state.global_step)
            return control
        if stopping:
            self.stopped = self.stop.raised or "a signal on another rank"
            control.should_training_stop = True
            if self.comm.rank == 0:
                log.warning("stopping at step %d (%s): the Trainer saves, then ends", state.global_step, self.stopped)
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> TrainerControl:
        folder = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        self.comm.barrier()  # every process has written its part (the RNG files are per process)
        self.interval.saving(state.global_step)
        blocked = self.manager.save_folder(state.global_step, folder, self.comm.barrier)
        self.interval.saved(blocked)
        self.last_saved = state.global_step
        if self.comm.local_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)  # the committed copy is in the manager's folder
        if self.comm.rank == 0:
            log.info("checkpoint step %d committed (loop blocked %.3f s)", state.global_step, blocked)
        return control

    def close(self) -> int:
        """Wait for the uploads and return the exit code (training.ckpt.checkpointer.finish)."""
        return process_exit(finish(self.manager, self.comm, self.stop.raised, self.stopped is not None, self.deadline,
                                   self.last_saved if self.refused else None))
