"""A user's own FSDP2 training loop (`fully_shard`), made spot-safe with the checkpoint library:
the same three lines as a replicated loop (examples/plain_loop.py). The Checkpointer sees the
sharded parameters and has every rank write its own shard; a restart resumes at any world size.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_loop.py --steps 300
    torchrun --standalone --nproc-per-node 3 examples/fsdp_loop.py --steps 300   # resharded resume

Checkpoints go where the stack's trainer contract says (CHECKPOINT_URL, CHECKPOINT_DIR,
CHECKPOINT_EVERY) or to --checkpoint-dir. SIGTERM (the spot notice) saves and stops. After a
resume it prints `resumed at step <N> params_sha256=<hex>`, and at the end
`final step=<N> params_sha256=<hex>`: the hash of the full parameters, gathered from the shards,
so runs of any world size compare.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from training.ckpt.checkpointer import Checkpointer
from training.ckpt.sharded import full_params_sha256


def build(seed: int) -> nn.Sequential:
    """The model, the same on every rank before it is sharded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(seed: int, step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step, a function of (seed, step, rank): what makes resume exact."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(size, 16, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def shard(model: nn.Sequential) -> nn.Sequential:
    """FSDP2: each Linear its own unit, then the root; over every rank of the process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", default=None, help="steps, or auto")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sleep-ms", type=int, default=0, help="slow each step down (lets a test interrupt it)")
    parser.add_argument("--pause-at", type=int, default=0,
                        help="after this step, wait for a stop signal (lets a test stop it at a known step)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Your launcher's process group (torchrun sets RANK / WORLD_SIZE); FSDP2 needs it first.
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build(args.seed)
    if dist.is_initialized():
        shard(model)  # before the optimizer: it must hold the sharded parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)

    # The three lines: open, resume, checkpoint after each step (and stop when told to).
    with Checkpointer(args.checkpoint_every, local_dir=args.checkpoint_dir,
                      model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        start = ckpt.resume()
        if start:
            digest = full_params_sha256(model)  # every rank gathers; rank 0 gets the hash
            if rank == 0:
                print(f"resumed at step {start} params_sha256={digest}\n", end="", flush=True)
        for step in range(start, args.steps):
            x, y = batch(args.seed, step, rank)
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            optimizer.zero_grad()
            torch.autograd.backward(loss)  # FSDP2 reduce-scatters the gradients across the ranks
            optimizer.step()
            scheduler.step()
            time.sleep(args.sleep_ms / 1000)
            while step + 1 == args.pause_at and ckpt.stop.raised is None:
                time.sleep(0.05)
            if ckpt.step(step + 1):
                break
        else:
            ckpt.save(args.steps)  # the finished state: a restart finds nothing left to do
            digest = full_params_sha256(model)
            if rank == 0:
                print(f"final step={args.steps} params_sha256={digest}\n", end="", flush=True)
    return ckpt.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
