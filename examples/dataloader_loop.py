"""A DDP loop written the usual way — a shuffling `DistributedSampler`, a `DataLoader`, dropout,
epochs, gradient accumulation with `no_sync` — made spot-safe by passing the loader to the
Checkpointer with the model: it then resumes bit-exactly, mid-epoch included.

    torchrun --standalone --nproc-per-node 2 examples/dataloader_loop.py --steps 40
    torchrun --standalone --nproc-per-node 2 examples/dataloader_loop.py --stateful   # torchdata's loader

The one rule: pass the loader (`loader=loader`) and start the epoch loop at `ckpt.epoch`. It
ends with `final step=<N> params_sha256=<hex>`; each step's line carries a digest of the samples
it trained on (`--augment`: with noise drawn in the loader's workers).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from training.ckpt.checkpointer import Checkpointer


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random noise on each sample, drawn where the sample is loaded (a worker's RNG stream)."""

    def __init__(self, base: TensorDataset, scale: float):
        self.base, self.scale = base, scale

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[index]
        return (x + self.scale * torch.randn(x.shape), y) if self.scale else (x, y)


def make_loader(args: argparse.Namespace, data: Dataset[Any],
                distributed: bool) -> tuple[DistributedSampler[Any] | None, DataLoader[Any]]:
    """A plain DataLoader (or torchdata's StatefulDataLoader), with a DistributedSampler under
    torchrun (or, --no-sampler, shuffle=True on every rank)."""
    sampler: DistributedSampler[Any] | None = (DistributedSampler(data, shuffle=True, seed=3)
                                               if distributed and not args.no_sampler else None)
    make: type[DataLoader[Any]] = DataLoader
    if args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]
        make = StatefulDataLoader
    return sampler, make(data, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None, drop_last=True,
                         num_workers=args.workers,
                         multiprocessing_context=args.start_method if args.workers else None)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--start-method", choices=["fork", "forkserver", "spawn"], default=None,
                        help="how the workers start (the platform's default unless given)")
    parser.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader")
    parser.add_argument("--no-sampler", action="store_true", help="no DistributedSampler: shuffle=True")
    parser.add_argument("--augment", type=float, default=0.0, help="noise drawn per sample where it is loaded")
    parser.add_argument("--epochs", type=int, default=1000, help="epochs in all (the run also ends at --steps)")
    parser.add_argument("--sleep-ms", type=int, default=0, help="slow each step down (lets a test interrupt it)")
    parser.add_argument("--pause-at", type=int, default=0,
                        help="after this step, wait for a stop signal (lets a test stop it at a known step)")
    return parser.parse_args()


def main() -> int:
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    features = torch.randn(args.samples, 16)
    data = TensorDataset(features, (features.sum(dim=1, keepdim=True) > 0).float())
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    sampler, loader = make_loader(args, Augmented(data, args.augment), distributed)
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else None

    # The rule: the loader is state like the model; the epoch loop starts at ckpt.epoch.
    with Checkpointer(model=model, optimizer=optimizer, loader=loader) as ckpt:
        step = ckpt.resume()
        stopped = False
        for epoch in range(ckpt.epoch, args.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            seen = hashlib.sha256()
            for i, (x, y) in enumerate(loader):
                seen.update(x.numpy().tobytes())  # the samples, their order and their noise
                last = (i + 1) % args.accumulate == 0
                # Accumulating: no gradient all-reduce until the batch that ends the optimizer step.
                with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                    loss = nn.functional.binary_cross_entropy_with_logits((ddp or model)(x), y) / args.accumulate
                    torch.autograd.backward(loss)
                if not last:
                    continue
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if ckpt.comm.rank == 0:
                    logging.info("step %d epoch %d batch %d data %s", step, epoch, i + 1, seen.hexdigest()[:16])
                seen = hashlib.sha256()
                time.sleep(args.sleep_ms / 1000)
                while step == args.pause_at and ckpt.stop.raised is None:
                    time.sleep(0.05)
                if ckpt.step(step) or step >= args.steps:
                    stopped = step < args.steps
                    break
            if stopped or step >= args.steps:
                break
        if not stopped:
            ckpt.save(step)  # the finished state: a restart finds nothing left to do
            digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
            if ckpt.comm.rank == 0:
                print(f"final step={step} params_sha256={digest.hexdigest()}\n", end="", flush=True)
    return ckpt.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
