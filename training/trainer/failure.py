"""A worker's fault as one line where the entrypoint asked (GTS_FAILURE_FILE): the entrypoint says
it last, below the launcher's report of the failed worker (torchrun's ChildFailedError), which
names no cause. The traceback stays in the worker's log above it.

The file outlives torchrun's restarts (--max-restarts), so each line carries the attempt it
came from (TORCHELASTIC_RESTART_COUNT) and `python -m training.trainer.failure FILE` prints the
first fault of the last attempt, not a stale one from an attempt that was restarted.

A worker whose collective broke because a peer is gone (a lost node) leaves at once: its
traceback printed, its non-daemon threads joined and its exit handlers run as the interpreter
would, then the process ends without the interpreter's finalisation, where the broken process
group's teardown kept a worker here about 1.4 s after its exit handlers had run, and its agent
(which restarts the run only once its worker has exited) with it (issue 46, docs/recovery.md)."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import traceback
from collections.abc import Callable

# What a collective raises when a peer's process is gone: torch's distributed errors
# (torch.distributed.DistError and its subclasses: DistBackendError from NCCL, DistNetworkError,
# DistStoreError), and gloo's transport errors, raised as RuntimeError (gloo/transport/tcp/pair.cc:
# "Read error ... Connection reset by peer", "Connection closed by peer", a socket closed or timed out).
GLOO_TRANSPORT = "gloo/transport/"
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Socket closed", "Broken pipe", "Timed out")


def noted(main: Callable[[], int]) -> int:
    """`main()`, its exception noted first (the trainer's `python -m` entry)."""
    try:
        return main()
    except Exception as exc:
        note(exc)
        if peer_gone(exc):
            leave_now(exc)
        raise


def peer_gone(exc: BaseException) -> bool:
    """True for the error a collective raises when a peer's process is gone (see GLOO_TRANSPORT)."""
    # by name: this module is also the entrypoint's `python -m ... FILE`, which must not import torch (1.2 s)
    if any(k.__name__ == "DistError" and k.__module__.startswith("torch") for k in type(exc).__mro__):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and GLOO_TRANSPORT in text and any(s in text for s in PEER_GONE)


def leave_now(exc: BaseException, code: int = 1) -> None:
    """What the interpreter does with an uncaught exception up to its exit handlers (the
    traceback on stderr, non-daemon threads joined, atexit handlers run, which flush logging),
    then exit with `code` (1, as for an uncaught exception), skipping the finalisation."""
    traceback.print_exception(exc)
    # the interpreter's own first step at exit (Py_FinalizeEx: wait_for_thread_shutdown) joins the
    # non-daemon threads and runs threading's exit hooks (concurrent.futures' pools finish their work)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    else:
        for thread in threading.enumerate():
            if not thread.daemon and thread is not threading.current_thread():
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say on it
            pass
    try:  # C's stdio buffers too (native libraries' lines, NCCL_DEBUG's on a pipe), which exit() would flush
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


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
