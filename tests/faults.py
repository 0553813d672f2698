"""The trainer with faults injected from the environment — for tests only, so that production
code carries no fault hooks. Launch it where the trainer would be launched:

    torchrun --standalone --nproc-per-node 2 -m tests.faults --workload tiny ...

GTS_TEST_SLOW_COMMIT_S=<s> [GTS_TEST_SLOW_COMMIT_STEP=<n>]: pause between a checkpoint's data
files and its commit (a slow disk, or a kill in the middle of a checkpoint).
GTS_TEST_DISK_FULL_STEP=<n>: the write of step n's checkpoint fails with ENOSPC (-1: every one).
GTS_TEST_CLOCK_START=<unix time> GTS_TEST_CLOCK_STEP_S=<s>: the reservation's clock
(training/reservation.py CLOCK) starts there and moves on by <s> each time the loop reads it (once
per step, on every rank alike).
GTS_TEST_COMPUTE_MS=<ms> [GTS_TEST_SLOW_RANK=<r> GTS_TEST_SLOW_FACTOR=<x>]: every forward pass takes
<ms> more (a steady stand-in for a GPU's kernels: a 2-core machine's own timing is noise), rank r's
x times that (a straggler).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.ckpt import manager as checkpoint
from training.trainer import train

log = logging.getLogger("gts.faults")


def _slow_commits(seconds: float, at_step: int) -> None:
    original = checkpoint.CheckpointManager._commit

    def slow_commit(self: checkpoint.CheckpointManager, step: int, tmp: Path, final: Path,
                    known: dict[str, tuple[int, str]] | None = None) -> Any:
        if at_step in (-1, step):
            log.warning("fault injection: pausing %.1f s before committing %s", seconds, final.name)
            time.sleep(seconds)
        return original(self, step, tmp, final, known)

    checkpoint.CheckpointManager._commit = slow_commit  # type: ignore[method-assign]


def _full_disk(at_step: int) -> None:
    """The background write of step `at_step` (-1: every step) fails as on a full disk."""
    original: Callable[..., tuple[int, str]] = getattr(checkpoint, "save_hashed")

    def full(obj: Any, path: Path, *copying: Any) -> tuple[int, str]:
        if at_step in (-1, int(path.parent.name.split("-")[1].split(".")[0])):
            log.warning("fault injection: no space left writing %s", path.parent.name)
            raise OSError(28, "No space left on device")
        return original(obj, path, *copying)

    setattr(checkpoint, "save_hashed", full)


def _fake_clock(start: float, step_s: float) -> None:
    from training import reservation

    now = [start - step_s]

    def tick() -> float:
        now[0] += step_s
        return now[0]

    reservation.CLOCK = tick


def _compute(ms: float, slow_rank: int, factor: float) -> None:
    original: Callable[..., Any] = getattr(train, "build_model")
    rank = int(os.environ.get("RANK", "0"))
    pause = ms / 1000 * (factor if rank == slow_rank else 1.0)

    def build(*args: Any, **kwargs: Any) -> Any:
        model = original(*args, **kwargs)
        model.register_forward_hook(lambda *_: time.sleep(pause))
        return model

    setattr(train, "build_model", build)


def install() -> None:
    if os.environ.get("GTS_TEST_CLOCK_START"):
        _fake_clock(float(os.environ["GTS_TEST_CLOCK_START"]), float(os.environ.get("GTS_TEST_CLOCK_STEP_S", "60")))
    if os.environ.get("GTS_TEST_COMPUTE_MS"):
        _compute(float(os.environ["GTS_TEST_COMPUTE_MS"]), int(os.environ.get("GTS_TEST_SLOW_RANK", "-1")),
                 float(os.environ.get("GTS_TEST_SLOW_FACTOR", "1")))
    if os.environ.get("GTS_TEST_DISK_FULL_STEP"):
        _full_disk(int(os.environ["GTS_TEST_DISK_FULL_STEP"]))
    slow = float(os.environ.get("GTS_TEST_SLOW_COMMIT_S", "0"))
    if slow:
        _slow_commits(slow, int(os.environ.get("GTS_TEST_SLOW_COMMIT_STEP", "-1")))


if __name__ == "__main__":
    install()
    sys.exit(train.main())
