"""A plain PyTorch training loop that is not ours, made spot-safe with the checkpoint library.

    python examples/plain_loop.py --steps 300                      # one process
    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py --steps 300

Checkpoints go where the stack's trainer contract says (CHECKPOINT_URL, CHECKPOINT_DIR,
CHECKPOINT_EVERY) or to --checkpoint-dir. SIGTERM (the spot notice) saves and stops; the next
start resumes exactly where it stopped. It ends with `final step=<N> params_sha256=<hex>`.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import time

import torch
from torch import nn

from training.ckpt.checkpointer import Checkpointer


def batch(seed: int, step: int, rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step, a function of (seed, step, rank): what makes resume exact."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(size, 16, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sleep-ms", type=int, default=0, help="slow each step down (lets a test interrupt it)")
    parser.add_argument("--pause-at", type=int, default=0,
                        help="after this step, wait for a stop signal (lets a test stop it at a known step)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)

    # The three lines: open, resume, checkpoint after each step (and stop when told to).
    with Checkpointer(args.checkpoint_every, local_dir=args.checkpoint_dir,
                      model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        for step in range(ckpt.resume(), args.steps):
            x, y = batch(args.seed, step, ckpt.comm.rank)
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            optimizer.zero_grad()
            torch.autograd.backward(loss)
            for p in model.parameters():  # what DDP would do, without wrapping the model
                if ckpt.comm.distributed and p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= ckpt.comm.world
            optimizer.step()
            scheduler.step()
            time.sleep(args.sleep_ms / 1000)
            while step + 1 == args.pause_at and ckpt.stop.raised is None:
                time.sleep(0.05)
            if ckpt.step(step + 1):
                break
        else:
            ckpt.save(args.steps)  # the finished state: a restart finds nothing left to do
            digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
            if ckpt.comm.rank == 0:
                print(f"final step={args.steps} params_sha256={digest.hexdigest()}\n", end="", flush=True)
    return ckpt.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
