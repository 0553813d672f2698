"""Train with spot-safe checkpoints and exact resume.

    # one node, all its GPUs (or 2 CPU processes)
    torchrun --standalone --nproc-per-node 8 -m training.trainer.train --workload resnet50 --data-dir /scratch/datasets/current
    # several nodes (the node bootstrap / Kubernetes Job set NODE_RANK and RDZV_ENDPOINT)
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $RDZV_ENDPOINT -m training.trainer.train
    # accelerate on CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m training.trainer.train
    # Horovod (images that ship it): horovodrun -np 8 python -m training.trainer.train --launcher horovod
    # a model sharded over the ranks (FSDP2; gloo on CPU, NCCL on GPUs), resumable at any world size
    torchrun --standalone --nproc-per-node 4 -m training.trainer.train --workload gpt-tiny --sharding fsdp

Checkpoints go to --checkpoint-dir every --checkpoint-every steps and on SIGTERM / SIGINT
(finish the step, save, upload, exit 0); at start the newest complete checkpoint (local disk
first, then the bucket) is restored, so a restarted run continues bit-identically. Rank 0
ends with `final step=<N> loss=<repr> params_sha256=<hex>`.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # first, before torch: the bucket's newest step is fetched meanwhile (early.py)
    from training.trainer.early import prefetch_early

    prefetch_early(sys.argv[1:])

import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from training.trainer import config as config_mod, failure
from training.ckpt.manager import CheckpointManager, RunLocked, Topology, UploadStatus
from training.ckpt.storage import StorageRefused
from training.ckpt.checkpointer import Interval, StopFlag, finish, rng_state, set_rng_state
from training.ckpt.peer.tier import PeerTier, choose, open_tier
from training.ckpt.run_control import HistoryUnknown, refuse, say_refused, say_storage
from training.trainer.build import build_data, build_model, final_digest, fully_restored, lr_lambda, refusal, too_small
from training.trainer.restore import own_moments, restore_model
from training.trainer.data import ResumableSampler, derived_seed
from training.distributed import Comm
from training.loaders import warn_fork_hang
from training.trainer.metrics import Metrics
from training.trainer.progress import Progress
from training.trainer.tracking import Tracker
from training.wallcost import WallCost

if TYPE_CHECKING:
    from training.ckpt.peer.sharded import ShardedPeer
    from training.ckpt.sharded import ShardedCheckpoints

log = logging.getLogger("gts.train")

EXIT_USAGE = 2
STOP_PEER_S = 5.0  # a stop's peer copy, sent after its durable checkpoint, waits at most this long
REFUSED = "the checkpoint storage's refusal"  # the loop's answer when the store refused the uploads


class Run:
    """One training process: model, optimizer, checkpoints and metrics, resumed and run."""

    def __init__(self, cfg: config_mod.TrainConfig, comm: Comm):
        self.cfg, self.comm = cfg, comm
        self.stop = StopFlag(cfg.upload_deadline_s)
        self.dataset = build_data(cfg)
        self.sharded: ShardedCheckpoints | None = None  # the sharded path's checkpoints (open_checkpoints)
        self.peer: PeerTier | ShardedPeer | None = None  # copies in other nodes' memory (PEER_EVERY), of either state
        self.deferred_init = False  # the model was built without initial values (build_model)
        self.use_scaler = cfg.precision == "fp16" and comm.device.type == "cuda"
        self.metrics = Metrics(cfg.metrics_port if comm.local_rank == 0 else 0, cfg.node_hourly_usd,
                               {"node": str(comm.node), "workload": cfg.workload,
                                # set by the node's env file or the Job; empty elsewhere
                                "cloud": os.environ.get("GTS_CLOUD", ""), "group": os.environ.get("GTS_NODE_GROUP", ""),
                                "team": os.environ.get("GTS_TEAM", "")})
        self.step, self.epoch, self.offset, self.last_saved, self.last_loss = 0, 0, 0, 0, float("nan")
        self.run_id: str | None = None  # the MLflow run, as global rank 0 opened it
        self.interval = Interval(cfg.checkpoint_every, comm, cfg.mtbf_s, cfg.notice_s)
        self.wall = WallCost()
        self.progress = Progress(comm, cfg.local_and_remote()[1] or cfg.local_and_remote()[0], self.metrics)

    def build_model(self) -> None:
        """Model, optimizer, schedule and scaler, then the per-rank random streams. Replicated
        models are built on the meta device and given memory without initial values when a
        checkpoint will fill them (issue 34: initialising 83M parameters costs about as much as
        reading them); `initialise` gives them the seed's values when no checkpoint did."""
        cfg, comm = self.cfg, self.comm
        classes = len(getattr(self.dataset, "classes", ()))
        model = build_model(cfg, classes, "meta") if cfg.sharding != "fsdp" else None
        if model is not None and fully_restored(model):
            self.model, self.deferred_init = model.to_empty(device=comm.device), True
        else:
            self.model = build_model(cfg, classes).to(comm.device)
        if cfg.sharding == "fsdp":  # before the optimizer: it must hold the sharded parameters
            from training.ckpt.sharded import shard  # torch's DCP and DTensor: imported only for sharded runs (0.7 s)

            shard(self.model, list(getattr(self.model, "blocks", [])), comm)
        # Fused (one kernel over all parameters) where torch has it for the device: on the CPU it
        # took AdamW's step over 83M parameters from about 0.4 s to 0.05 s here (issue 34); sharded
        # (DTensor) parameters keep torch's default implementation.
        fused = cfg.sharding != "fsdp" and comm.device.type in ("cpu", "cuda")
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                                                  weight_decay=cfg.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_scaler)
        self.seed_streams()

    def seed_streams(self) -> None:
        # Per-rank streams (dropout and the like) differ by rank; data order does not depend on them.
        random.seed(derived_seed(self.cfg.seed, self.comm.rank))
        np.random.seed(derived_seed(self.cfg.seed, self.comm.rank) % (1 << 32))
        torch.manual_seed(derived_seed(self.cfg.seed, self.comm.rank, 1))

    def initialise(self) -> None:
        """No checkpoint was restored: the values a model built on the CPU from the seed has
        (the same ones, bit for bit), then the per-rank streams seeded as after a plain build."""
        if self.deferred_init:
            self.model.load_state_dict(build_model(self.cfg, len(getattr(self.dataset, "classes", ()))).state_dict())
            self.deferred_init = False
            self.seed_streams()

    def open_checkpoints(self) -> CheckpointManager | None:
        """The run's checkpoint manager, or None on every rank when another trainer holds the run."""
        local_dir, remote = self.cfg.local_and_remote()
        topo = Topology(self.comm.rank, self.comm.local_rank, self.comm.world, self.comm.node, self.comm.nnodes,
                        self.comm.local_world)
        try:
            ckpt: CheckpointManager | None = CheckpointManager(local_dir, remote or None, topo, keep=self.cfg.keep,
                                                               on_status=self._on_status,
                                                               for_device=self.comm.device.type != "cpu")
            locked = False
        except RunLocked as exc:
            refuse(str(exc))
            ckpt, locked = None, True
        (anyone_locked,) = self.comm.any_true(locked)
        if ckpt is not None and not anyone_locked and self.cfg.sharding == "fsdp":
            from training.ckpt.sharded import ShardedCheckpoints

            self.sharded = ShardedCheckpoints(ckpt, self.comm)
        return None if anyone_locked else ckpt

    def _on_status(self, status: UploadStatus) -> None:
        self.metrics.upload_pending.set(len(status.pending))
        if status.last_success:
            self.metrics.upload_time.set(status.last_success)
        if status.last_commit:  # the commit, not the copy: the stale-checkpoint alert reads it
            self.metrics.checkpoint_time.set(status.last_commit)
        self.interval.status(status)

    def resume(self, ckpt: CheckpointManager) -> str | None:
        """Restore the newest usable checkpoint. Returns why the run must not go on (already
        complete, or its result-shaping config changed), or None to train."""
        if self.sharded is not None:  # peers (a whole set of shards), disk, bucket; never a mix
            from training.ckpt.peer import sharded as peer_sharded

            self.peer = peer_sharded.open_sharded(self.peer, self.model, self.optimizer)  # over the same stores
            found = peer_sharded.choose(self.sharded, self.peer)
        else:
            found = choose(ckpt, self.comm, self.peer if isinstance(self.peer, PeerTier) else None)
        if found is None:
            self.initialise()
            return None
        state = found.state
        verdict = refusal(self.cfg, found.step, state, self.comm.rank)
        if self.sharded is not None:  # each rank reads its shard's pieces, any saved world size (a verdict: none)
            peer_sharded.restore(self.sharded, self.peer, found.step, self.model, self.optimizer,
                                 int(state.get("world_size", 0)), load=verdict is None)
        if verdict is not None:
            return verdict
        if self.sharded is None:
            assigned = restore_model(self.model, self.optimizer, state["model"],
                                     self.deferred_init and self.comm.device.type == "cpu")
            self.optimizer.load_state_dict(state["optimizer"])
            if not assigned:
                own_moments(self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.use_scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        saved_world = int(state.get("world_size", self.comm.world))
        self.step, self.epoch, self.run_id = state["step"], state["epoch"], state.get("mlflow_run_id")
        # The epoch's position in samples, re-cut for this world size (elastic runs change it).
        self.offset = state["offset"] * saved_world // self.comm.world
        if found.rng is not None:
            set_rng_state(found.rng)
        elif self.comm.rank == 0:
            log.warning("world size %d -> %d since step %d: data position kept, per-rank RNG streams re-seeded",
                        saved_world, self.comm.world, found.step)
        self.last_saved = found.durable  # a peer copy is not durable: auto's clock runs from the bucket's step
        log.info("resumed from step %d (epoch %d, batch %d of the epoch)", self.step, self.epoch, self.offset)
        return None

    def state(self, tracker: Tracker) -> dict[str, Any] | None:
        """What a checkpoint holds besides the RNG streams: all of it (replicated, on a node's local
        rank 0), the rest beside the shards (sharded), or None (replicated, other ranks)."""
        if self.sharded is None and self.comm.local_rank != 0:
            return None
        state = {"scheduler": self.scheduler.state_dict(), "step": self.step, "epoch": self.epoch,
                 "offset": self.offset, "mlflow_run_id": self.run_id, "config": config_mod.as_dict(self.cfg),
                 "world_size": self.comm.world}
        if self.sharded is None:
            state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                         scaler=self.scaler.state_dict() if self.use_scaler else None)
        return state

    def save(self, ckpt: CheckpointManager, tracker: Tracker) -> None:
        self.progress.busy(self.cfg.upload_deadline_s + 3 * self.progress.blocked)  # the watchdog waits
        state = self.state(tracker)
        self.interval.saving(self.step)
        if self.sharded is not None:
            assert state is not None
            blocked = self.sharded.save(self.step, self.model, self.optimizer, state, rng_state())
        else:
            blocked = ckpt.save(self.step, state, rng_state(), self.comm.barrier)
        self.last_saved = self.step
        self.interval.saved(blocked)
        self.progress.saved_checkpoint(self.step, blocked)
        self.metrics.checkpoint_seconds.set(blocked)
        if self.comm.rank == 0:
            log.info("checkpoint step %d: loop blocked %.3f s", self.step, blocked)
        self._wall_cost(self.wall.checkpoint(blocked))

    def _wall_cost(self, seconds: float | None) -> None:
        """A checkpoint's whole cost to the loop, once its write is done (training/wallcost.py)."""
        if seconds is None:
            return
        self.metrics.checkpoint_wall_seconds.set(seconds)
        if self.comm.rank == 0:
            log.info("checkpoint wall cost %.3f s (blocked and slower steps while it was written)", seconds)

    def checkpoint_due(self) -> bool:
        """Every --checkpoint-every steps, or with auto when rank 0's planner says so (the ranks
        combine the flag, so they all save at the same step)."""
        due = self.interval.due(self.step, self.last_saved)
        if self.interval.steps is not None:
            self.metrics.checkpoint_interval.set(self.interval.steps)
        return due

    def train_step(self, ddp_model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   writing: bool = False) -> None:
        cfg, comm = self.cfg, self.comm
        started = self.progress.mark(time.perf_counter())  # marks: the GPU's own times (progress.GpuTimes)
        inputs, labels = inputs.to(comm.device), labels.to(comm.device)
        if cfg.workload == "resnet50" and cfg.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(comm.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            out = ddp_model(inputs)
            loss: torch.Tensor = nn.functional.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out,
                                                             labels.flatten())
        forwarded = self.progress.mark(time.perf_counter())
        scaled: torch.Tensor = self.scaler.scale(loss)
        torch.autograd.backward(scaled)
        waited = self.progress.mark(time.perf_counter()) - forwarded  # backward: DDP's all-reduce waits here
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.progress.mark(0.0)
        self.step, self.offset = self.step + 1, self.offset + 1
        self.last_loss = comm.mean(loss)
        elapsed = time.perf_counter() - started
        self._wall_cost(self.wall.step(elapsed, writing))
        self.metrics.step.set(self.step)
        self.metrics.loss.set(self.last_loss)
        self.metrics.step_seconds.set(elapsed)
        self.progress.stepped(self.step, elapsed, elapsed - waited)
        self.metrics.samples_per_second.set(cfg.batch_size * comm.world / max(elapsed, 1e-9))
        if cfg.throttle_ms:
            time.sleep(cfg.throttle_ms / 1000)

    def loop(self, ckpt: CheckpointManager, tracker: Tracker) -> str | None:
        """Train to --steps; returns what interrupted it (a signal here or on another rank) or None."""
        cfg, comm = self.cfg, self.comm
        ddp_model = self.model  # FSDP2 shards the model itself: no wrapper
        if self.sharded is None:
            ddp_model, self.optimizer = comm.wrap(self.model, self.optimizer)
        sampler = ResumableSampler(len(self.dataset), comm.world, comm.rank, cfg.seed)
        batches_per_epoch = len(self.dataset) // comm.world // cfg.batch_size
        if batches_per_epoch == 0:  # refused at start (build.too_small); never spin on an empty epoch
            raise RuntimeError("no batch in an epoch")
        while self.step < cfg.steps:
            if self.offset >= batches_per_epoch:
                self.epoch, self.offset = self.epoch + 1, 0
            sampler.set_epoch(self.epoch, start=self.offset * cfg.batch_size)
            if hasattr(self.dataset, "epoch"):
                self.dataset.epoch = self.epoch
            loader = DataLoader(self.dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                                num_workers=cfg.num_workers, persistent_workers=False,
                                generator=torch.Generator().manual_seed(derived_seed(cfg.seed, self.epoch)))
            warn_fork_hang("trainer", loader, fix="set num_workers to 0")  # once a process, where affected
            for inputs, labels in loader:
                self.train_step(ddp_model, inputs, labels, writing=ckpt.writing)
                if self.step % cfg.log_every == 0:
                    self.metrics.refresh()
                    tracker.log(self.step, {"loss": self.last_loss, "lr": float(self.scheduler.get_last_lr()[0])})
                    if comm.rank == 0:
                        log.info("step %d loss %.5f", self.step, self.last_loss)
                stopping, asked, due, refused = comm.any_true(
                    self.stop.poll() is not None, self.stop.take_checkpoint_request(), self.checkpoint_due(),
                    bool(ckpt.refused))
                if self.peer is not None and not stopping and self.peer.due(self.step):
                    self.progress.peer_copy(self.peer, self.step, self.state(tracker), rng_state())
                if due or stopping or asked or refused or self.step >= cfg.steps:
                    self.save(ckpt, tracker)
                if stopping and self.peer is not None:  # after the durable save: a buddy gone costs seconds
                    self.progress.peer_copy(self.peer, self.step, self.state(tracker), rng_state(), STOP_PEER_S)
                if refused:  # the bucket is gone or refuses writes: finish() names it, exit 2
                    say_refused(ckpt, comm, self.step)
                    return REFUSED
                if stopping:
                    return self.stop.raised or "a signal on another rank"
                if self.step >= cfg.steps:
                    break
        return None

    def execute(self) -> int:
        small = too_small(self.cfg, len(self.dataset), self.comm.world)
        if small is not None:
            if self.comm.rank == 0:
                refuse(small)
            return EXIT_USAGE
        ckpt = self.open_checkpoints()
        if ckpt is None:
            return EXIT_USAGE
        self.peer = open_tier(self.comm)
        if self.sharded is None and (self.peer is None or not self.peer.steps()):  # peers hold newer: no prefetch
            ckpt.prefetch()  # the newest step is fetched and checked while the model is built
        elif self.sharded is None and self.peer is not None:
            self.peer.prefetch()  # so is the peers' newest copy, once per node
        self.build_model()
        try:
            verdict = self.resume(ckpt)
        except (StorageRefused, HistoryUnknown) as exc:  # no such bucket, access denied: exit 2; unread: a restart
            ckpt.close(timeout=0)
            return say_storage(self.comm, exc)
        ckpt.end_prefetch()  # a prefetched step the ranks did not choose is not held for the run
        ckpt.resync()  # committed steps the bucket lacks (an outage before this start) go up now
        if verdict is not None:
            ckpt.close(timeout=self.cfg.upload_deadline_s)
            if self.comm.rank == 0:
                if verdict.startswith("complete"):  # e.g. killed in finish() after the last commit
                    log.info("run %s", verdict)
                    self.progress.ended(None, 0, self.cfg.steps)
                else:
                    refuse(f"run {verdict}")
            return 0 if verdict.startswith("complete") else EXIT_USAGE
        tracker = Tracker(self.comm.rank == 0, self.run_id, config_mod.as_dict(self.cfg))
        self.run_id = self.comm.all_gather_object(tracker.run_id)[0]  # every node's copies name rank 0's run
        try:
            interrupted = self.loop(ckpt, tracker)
        except BaseException as exc:
            self.progress.crashed(exc, self.last_saved)
            ckpt.wait_commit()  # a checkpoint already reported is committed before the process goes
            raise
        if self.last_saved != self.step:
            self.save(ckpt, tracker)
        self.progress.busy(self.cfg.upload_deadline_s + 30)  # finish() waits up to the deadline, then a barrier
        if self.sharded is not None:
            self.sharded.close()  # this rank's shard of the last checkpoint is written
        if self.peer is not None:
            self.peer.close(STOP_PEER_S if interrupted is not None else None)
        stopped = interrupted is not None and interrupted != REFUSED
        code = finish(ckpt, self.comm, self.stop.raised, stopped, self.cfg.upload_deadline_s, self.step)
        tracker.close(interrupted=interrupted is not None)
        self.progress.ended(interrupted, code, self.step)
        if stopped and code not in (1, EXIT_USAGE) and self.comm.rank == 0:
            log.warning("stopped by %s at step %d after an emergency checkpoint", interrupted, self.step)
        if interrupted is None and code == 0:
            digest = final_digest(self.model, self.sharded is not None, self.comm.rank)
            if self.comm.rank == 0:
                print(f"final step={self.step} loss={self.last_loss!r} params_sha256={digest}\n", end="", flush=True)
        return code


def main(argv: list[str] | None = None) -> int:
    cfg = config_mod.parse(argv)
    comm = Comm(cfg.launcher)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{comm.rank} %(name)s %(message)s")
    log.info("rank %d of %d (node %d of %d) via %s on %s", comm.rank, comm.world, comm.node, comm.nnodes,
             comm.launcher, comm.device)
    try:
        code = Run(cfg, comm).execute()
    finally:
        comm.close()
    if code == EXIT_USAGE and os.environ.get("GTS_REFUSAL_FILE"):
        return 0  # the entrypoint says it and exits 2; a failed worker would bury it in the launcher's traceback
    return code


if __name__ == "__main__":
    sys.exit(failure.noted(main))
