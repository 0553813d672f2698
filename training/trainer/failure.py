"""A worker's fault as one line where the entrypoint asked (GTS_FAILURE_FILE): the entrypoint says
it last, below the launcher's report of the failed worker (torchrun's ChildFailedError), which
names no cause. The traceback stays in the worker's log above it."""

from __future__ import annotations

import os
from collections.abc import Callable


def noted(main: Callable[[], int]) -> int:
    """`main()`, its exception noted first (the trainer's `python -m` entry)."""
    try:
        return main()
    except Exception as exc:
        note(exc)
        raise


def note(exc: BaseException) -> None:
    path = os.environ.get("GTS_FAILURE_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500] + "\n")
