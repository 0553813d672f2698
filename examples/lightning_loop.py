"""A PyTorch Lightning run made spot-safe: one callback, and `spot.fit` instead of `trainer.fit`.

    torchrun --standalone --nproc-per-node 2 examples/lightning_loop.py --max-steps 40

Checkpoints go where the stack's trainer contract says (CHECKPOINT_URL, CHECKPOINT_DIR,
CHECKPOINT_EVERY); SIGTERM (the spot notice) saves and stops; the next start resumes from the
newest good checkpoint, local or in the bucket. It ends with `final step=<N>`.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from training.ckpt.lightning import SpotCheckpoint


class Tiny(pl.LightningModule):
    def __init__(self, sleep_ms: int, pause_at: int = 0, stopped: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.sleep_ms = sleep_ms
        self.pause_at, self.stopped = pause_at, stopped

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), y)
        if self.global_rank == 0:
            logging.info("step %d loss %.5f", self.global_step + 1, float(loss))
        time.sleep(self.sleep_ms / 1000)
        while self.global_step + 1 == self.pause_at and not self.stopped():
            time.sleep(0.05)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--sleep-ms", type=int, default=0, help="slow each step down (lets a test interrupt it)")
    parser.add_argument("--pause-at", type=int, default=0,
                        help="at this step, wait for a stop signal (lets a test stop it at a known step)")
    parser.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader (refused)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    pl.seed_everything(0, workers=True)
    features = torch.randn(256, 16)
    make: type[DataLoader[Any]] = DataLoader
    if args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]
        make = StatefulDataLoader
    data = make(TensorDataset(features, (features.sum(dim=1, keepdim=True) > 0).float()), batch_size=8, shuffle=True)

    spot = SpotCheckpoint()  # before the Trainer: it joins the process group torchrun describes
    trainer = pl.Trainer(accelerator="auto", devices=spot.comm.local_world, num_nodes=spot.comm.nnodes, strategy="ddp",
                         max_steps=args.max_steps,
                         callbacks=[spot], enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir="out/lightning")
    model = Tiny(args.sleep_ms, args.pause_at, lambda: spot.stop.raised is not None)
    code = spot.fit(trainer, model, train_dataloaders=data)
    if code == 0 and spot.stopped is None and spot.comm.rank == 0:
        print(f"final step={trainer.global_step or spot.resumed_step}\n", end="", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
