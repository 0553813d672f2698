"""Train with spot-safe checkpoints and exact resume.

    # one node, all its GPUs (or 2 CPU processes)
    torchrun --standalone --nproc-per-node 8 -m training.train --workload resnet50 --data-dir /scratch/datasets/current
    # several nodes (the node bootstrap / Kubernetes Job set NODE_RANK and RDZV_ENDPOINT)
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $RDZV_ENDPOINT -m training.train
    # accelerate on CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m training.train
    # Horovod (images that ship it): horovodrun -np 8 python -m training.train --launcher horovod

Checkpoints go to --checkpoint-dir every --checkpoint-every steps and on SIGTERM / SIGINT
(finish the step, save, upload, exit 0); at start the newest complete checkpoint (local disk
first, then the bucket) is restored, so a restarted run continues bit-identically. Rank 0
ends with `final step=<N> loss=<repr> params_sha256=<hex>`.
"""

from __future__ import annotations

import hashlib
import os
import logging
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from training import config as config_mod
from training.checkpoint import CheckpointManager, Topology, UploadStatus
from training.data import ImageFolder, ResumableSampler, SyntheticClassification, derived_seed
from training.distributed import Comm
from training.metrics import Metrics
from training.models import ResNet50, TinyNet
from training.tracking import Tracker

log = logging.getLogger("gts.train")


class StopFlag:
    """Signal handlers only set flags; the loop combines them across ranks after each step.
    SIGTERM / SIGINT: checkpoint and stop. SIGUSR1 (a rebalance recommendation, or a person):
    checkpoint now and go on."""

    def __init__(self) -> None:
        self.raised: str | None = None
        self.checkpoint_requested = False
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


def params_sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build(cfg: config_mod.TrainConfig) -> tuple[SyntheticClassification | ImageFolder, nn.Module]:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    if cfg.workload == "tiny":
        return (SyntheticClassification(cfg.tiny_samples, cfg.tiny_dim, 10, cfg.seed),
                TinyNet(cfg.tiny_dim, cfg.tiny_width))
    data = ImageFolder(cfg.data_dir, cfg.image_size, cfg.seed)
    model = ResNet50(len(data.classes), cfg.grad_checkpointing)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return data, model


def lr_lambda(cfg: config_mod.TrainConfig) -> Any:
    import math

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def main(argv: list[str] | None = None) -> int:
    cfg = config_mod.parse(argv)
    comm = Comm(cfg.launcher)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{comm.rank} %(name)s %(message)s")
    log.info("rank %d of %d (node %d of %d) via %s on %s", comm.rank, comm.world, comm.node, comm.nnodes,
             comm.launcher, comm.device)
    stop = StopFlag()
    dataset, model = build(cfg)
    model.to(comm.device)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    use_scaler = cfg.precision == "fp16" and comm.device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    # Per-rank streams (dropout and the like) differ by rank; data order does not depend on them.
    random.seed(derived_seed(cfg.seed, comm.rank))
    np.random.seed(derived_seed(cfg.seed, comm.rank) % (1 << 32))
    torch.manual_seed(derived_seed(cfg.seed, comm.rank, 1))

    local_dir, remote = cfg.local_and_remote()
    topo = Topology(comm.rank, comm.local_rank, comm.world, comm.node, comm.nnodes, comm.local_world)
    metrics = Metrics(cfg.metrics_port if comm.local_rank == 0 else 0, cfg.node_hourly_usd,
                      {"node": str(comm.node), "workload": cfg.workload,
                       # set by the node's cloud-init (/etc/gpu-training/node.env); empty elsewhere
                       "cloud": os.environ.get("GTS_CLOUD", ""), "group": os.environ.get("GTS_NODE_GROUP", "")})

    def on_status(status: UploadStatus) -> None:
        metrics.upload_pending.set(len(status.pending))
        if status.last_success:
            metrics.upload_time.set(status.last_success)

    ckpt = CheckpointManager(local_dir, remote or None, topo, keep=cfg.keep, on_status=on_status)

    step, epoch, offset, run_id = 0, 0, 0, None
    # Resume from the newest step every rank can load (its node's disk or the bucket).
    common = set.intersection(*map(set, comm.all_gather_object(sorted(ckpt.loadable_steps()))))
    if common:
        resume = max(common)
        state, rng = ckpt.load(resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if use_scaler and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, epoch, offset, run_id = state["step"], state["epoch"], state["offset"], state.get("mlflow_run_id")
        set_rng_state(rng)
        log.info("resumed from step %d (epoch %d, batch %d of the epoch)", step, epoch, offset)
    ckpt.resync()
    ddp_model, optimizer = comm.wrap(model, optimizer)
    tracker = Tracker(comm.rank == 0, run_id, config_mod.as_dict(cfg))

    sampler = ResumableSampler(len(dataset), comm.world, comm.rank, cfg.seed)
    batches_per_epoch = len(dataset) // comm.world // cfg.batch_size
    loss_fn = nn.CrossEntropyLoss()
    last_saved = step
    last_loss = float("nan")

    def save(at: int) -> None:
        nonlocal last_saved
        state = None
        if comm.local_rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if use_scaler else None,
                     "step": at, "epoch": epoch, "offset": offset, "mlflow_run_id": tracker.run_id,
                     "config": config_mod.as_dict(cfg), "world_size": comm.world}
        blocked = ckpt.save(at, state, rng_state(), comm.barrier)
        last_saved = at
        metrics.checkpoint_seconds.set(blocked)
        metrics.checkpoint_time.set(time.time())
        if comm.rank == 0:
            log.info("checkpoint step %d: loop blocked %.3f s", at, blocked)

    interrupted = None
    while step < cfg.steps and interrupted is None:
        if offset >= batches_per_epoch:
            epoch, offset = epoch + 1, 0
        sampler.set_epoch(epoch, start=offset * cfg.batch_size)
        if hasattr(dataset, "epoch"):
            dataset.epoch = epoch
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                            num_workers=cfg.num_workers, persistent_workers=False,
                            generator=torch.Generator().manual_seed(derived_seed(cfg.seed, epoch)))
        for inputs, labels in loader:
            started = time.perf_counter()
            inputs, labels = inputs.to(comm.device), labels.to(comm.device)
            if cfg.workload == "resnet50" and cfg.channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(comm.device.type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                loss = loss_fn(ddp_model(inputs), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step, offset = step + 1, offset + 1
            last_loss = comm.mean(loss)
            elapsed = time.perf_counter() - started
            metrics.step.set(step)
            metrics.loss.set(last_loss)
            metrics.step_seconds.set(elapsed)
            metrics.samples_per_second.set(cfg.batch_size * comm.world / max(elapsed, 1e-9))
            if step % cfg.log_every == 0:
                metrics.refresh()
                tracker.log(step, {"loss": last_loss, "lr": float(scheduler.get_last_lr()[0])})
                if comm.rank == 0:
                    log.info("step %d loss %.5f (%.1f ms/step)", step, last_loss, elapsed * 1000)
            if cfg.throttle_ms:
                time.sleep(cfg.throttle_ms / 1000)
            stopping, asked = comm.any_true(stop.raised is not None, stop.take_checkpoint_request())
            if step % cfg.checkpoint_every == 0 or stopping or asked or step >= cfg.steps:
                save(step)
            if stopping:
                interrupted = stop.raised or "a signal on another rank"
                break
            if step >= cfg.steps:
                break

    if last_saved != step:
        save(step)
    status = ckpt.close(timeout=cfg.upload_deadline_s)
    tracker.close(interrupted=interrupted is not None)
    if interrupted:
        if comm.rank == 0:
            log.warning("stopped by %s at step %d after an emergency checkpoint%s", interrupted, step,
                        "" if not status.pending else f" ({len(status.pending)} upload(s) still pending)")
        comm.close()
        return 0
    if comm.rank == 0:
        print(f"final step={step} loss={last_loss!r} params_sha256={params_sha256(model)}", flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
