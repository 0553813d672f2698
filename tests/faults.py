"""The trainer with faults injected from the environment — for tests only, so that production
code carries no fault hooks. Launch it where the trainer would be launched:

    torchrun --standalone --nproc-per-node 2 -m tests.faults --workload tiny ...

GTS_TEST_SLOW_COMMIT_S=<s> [GTS_TEST_SLOW_COMMIT_STEP=<n>]: pause between a checkpoint's data
files and its commit (a slow disk, or a kill in the middle of a checkpoint).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from training import checkpoint, train

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


def install() -> None:
    slow = float(os.environ.get("GTS_TEST_SLOW_COMMIT_S", "0"))
    if slow:
        _slow_commits(slow, int(os.environ.get("GTS_TEST_SLOW_COMMIT_STEP", "-1")))


if __name__ == "__main__":
    install()
    sys.exit(train.main())
