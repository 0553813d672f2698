"""Process groups for the three launchers behind one small interface.

torchrun and `accelerate launch` both export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR, so
they share the torch.distributed path (gloo on CPU, NCCL on GPUs). Horovod wraps the optimizer
(`hvd.DistributedOptimizer`) and broadcasts parameters and optimizer state; it is an optional
extra for images that ship it (horovod 0.28.1 does not build against current torch).
"""

from __future__ import annotations

import atexit
import collections
import gc
import os
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Collectives whose work this process still holds (with their tensors), oldest first. When a
# collective's work is freed by the backend's own thread (gloo's run loop, NCCL's watchdog), the
# tensors' Python objects are released there, and that thread first creates a Python thread
# state, under the interpreter's thread-list lock and without the GIL. A fork at that instant
# (a DataLoader starting its workers right after the step's collective) leaves the child that
# lock held: CPython before 3.11.10 (and 3.10.15, 3.9.20) re-initialises it only after using it,
# and the child hangs in os.fork (CPython gh-112275). Held here, a work is freed by this thread,
# which holds the GIL: once HELD_WORKS newer collectives have completed and it is HELD_S old
# (gloo frees its reference as the collective ends; NCCL's watchdog drops its copy of a work on
# its next poll, every 100 ms in torch's ProcessGroupNCCL.cpp).
HELD_WORKS = 4
HELD_S = 2.0
_clock = time.monotonic  # the held works' clock (a test's fake one)


def detect_launcher(requested: str) -> str:
    if requested != "auto":
        return requested
    if "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return "horovod"
    if "ACCELERATE_MIXED_PRECISION" in os.environ or "ACCELERATE_USE_CPU" in os.environ:
        return "accelerate"
    return "torchrun"


class Comm:
    """rank / world / collectives, for a single process too (no launcher)."""

    def __init__(self, launcher: str):
        self.launcher = detect_launcher(launcher)
        self.hvd: Any = None
        if self.launcher == "horovod":
            import horovod.torch as hvd  # optional extra

            hvd.init()
            self.hvd = hvd
            self.rank, self.world = int(hvd.rank()), int(hvd.size())
            self.local_rank, self.local_world = int(hvd.local_rank()), int(hvd.local_size())
        else:
            self.rank = int(os.environ.get("RANK", 0))
            self.world = int(os.environ.get("WORLD_SIZE", 1))
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
            self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            if self.world > 1 and not dist.is_initialized():
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
            if self.world > 1:
                # Code that never calls close() (a Hugging Face script after spot.train, a plain
                # loop) still leaves together at exit: a gloo rank that exits while its peer ends
                # the last collective aborts it ("terminate called without an active exception").
                atexit.register(self.close)
        self._held: collections.deque[tuple[float, Any]] = collections.deque()
        self.node = self.rank // max(1, self.local_world)
        self.nnodes = max(1, self.world // max(1, self.local_world))
        self.device = torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.hvd is not None:
            self.hvd.allreduce(torch.zeros(1), name="barrier")
        elif self.distributed:
            dist.barrier()

    def _done(self, work: Any) -> None:
        """Wait for an asynchronous collective and keep its work (HELD_WORKS, HELD_S)."""
        work.wait()
        now = _clock()
        self._held.append((now, work))
        while len(self._held) > HELD_WORKS and now - self._held[0][0] > HELD_S:
            self._held.popleft()

    def any_true(self, *flags: bool) -> list[bool]:
        """For each flag: True on every rank if any rank says so (all ranks act at the same
        step). One collective, whatever the number of flags."""
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device if self.hvd is None else "cpu")
        if self.hvd is not None:
            t = self.hvd.allreduce(t, op=self.hvd.Max, name="flags")
        elif self.distributed:
            self._done(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        return [bool(v > 0) for v in t.tolist()]

    def mean(self, value: torch.Tensor) -> float:
        device = self.device if self.hvd is None else "cpu"
        t = value.detach().float().reshape(1).to(device, copy=True)  # reduced in place: not the caller's
        if self.hvd is not None:
            return float(self.hvd.allreduce(t, op=self.hvd.Average, name="mean").item())
        if self.distributed:
            self._done(dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True))
            t /= self.world
        return float(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order: torch's all_gather_object (pickled, sizes first,
        then the padded bytes) on collectives whose work this process keeps (HELD_WORKS)."""
        if self.hvd is not None:
            return list(self.hvd.allgather_object(obj))
        if not self.distributed:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._done(dist.all_gather(sizes, size, async_op=True))
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        self._done(dist.all_gather(gathered, padded, async_op=True))
        # Our own ranks' bytes, unpickled as torch's own all_gather_object does.
        return [pickle.loads(g[:n].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths)]

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.hvd is not None:
            self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            return model, self.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        if self.distributed:
            ids = [self.local_rank] if self.device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=ids), optimizer
        return model, optimizer

    def close(self) -> None:
        """Leave together: a rank that tears its connections down while a peer still receives
        the end of the last collective makes that peer abort (gloo: "terminate called")."""
        if self.hvd is None and dist.is_initialized():
            # Free what still refers to the groups' work first (an FSDP2 model and its optimizer
            # live in reference cycles): left to the interpreter's finalisation, gloo's worker
            # threads drop their last tensors without a live interpreter and the process aborts
            # ("terminate called", seen intermittently at the end of sharded runs; pytorch/pytorch
            # PR 179291 describes the mechanism).
            gc.collect()
            try:
                dist.barrier()
            except RuntimeError:
                pass  # a peer is gone already (a lost node): nothing to wait for
            dist.destroy_process_group()  # its threads joined: the kept works' last holder is this thread
        self._held.clear()  # freed here, with the interpreter (HELD_WORKS); also after a group the caller destroyed
