"""What the interpreter does at exit, for a process that must end before its finalisation: the
trainer's fast exit when a peer is gone (training/trainer/failure.py) and a warm-started worker,
which is a fork of the node's warm process and must never return into it (training/node/warm.py).
Standard library only."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading


def finish(code: int) -> None:
    """Non-daemon threads joined, atexit handlers run (which flush logging), Python's and C's
    streams flushed, then exit with `code`, skipping the finalisation."""
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
