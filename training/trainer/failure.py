"""A worker's fault as one line where the entrypoint asked (GTS_FAILURE_FILE): the entrypoint says
it last, below the launcher's report of the failed worker (torchrun's ChildFailedError), which
names no cause. The traceback stays in the worker's log above it.

The file outlives torchrun's restarts (--max-restarts), so each line carries the attempt it
came from (TORCHELASTIC_RESTART_COUNT) and `python -m training.trainer.failure FILE` prints the
first fault of the last attempt, not a stale one from an attempt that was restarted."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def noted(main: Callable[[], int]) -> int:
    """`main()`, its exception noted first (the trainer's `python -m` entry)."""
    try:
        return main()
    except Exception as exc:
        note(exc)
        raise


def note(exc: BaseException) -> None:
    """Append the fault; a file that cannot be written is skipped: the worker's own error, not an
    OSError about the note, is what propagates."""
    path = os.environ.get("GTS_FAILURE_FILE")
    if not path:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{attempt}\t" + f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500] + "\n")
    except OSError:
        pass


def last_attempts_fault(text: str) -> str:
    """The first fault noted by the last attempt (the one the run ended with)."""
    lines = [line.partition("\t") for line in text.splitlines() if "\t" in line]
    if not lines:
        return ""
    last = max(lines, key=lambda parts: int(parts[0]) if parts[0].isdigit() else -1)[0]
    return next(message for attempt, _, message in lines if attempt == last)


if __name__ == "__main__":
    try:
        with open(sys.argv[1], encoding="utf-8", errors="replace") as fh:
            print(last_attempts_fault(fh.read()))
    except (IndexError, OSError):
        pass
