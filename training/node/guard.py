"""Runs the launcher so that nothing outlives the entrypoint: `python -m training.node.guard CMD...`.

torchrun starts each worker in a session of its own, so when the entrypoint is SIGKILLed (an
OOM kill, `docker kill`, a person) neither a process-group signal nor the kernel would stop the
launcher or its workers: they would go on training, holding the GPUs and the run's lock. This
small process sits between them:

- it starts a session of its own (a terminal's Ctrl-C reaches the entrypoint only, which
  passes it on to the workers);
- it is a child subreaper (PR_SET_CHILD_SUBREAPER): workers orphaned by a dead launcher become
  its children, not init's;
- the kernel tells it when the entrypoint dies (PR_SET_PDEATHSIG), and it then SIGKILLs every
  process below it and exits; it does the same when the launcher dies and leaves workers behind.

Otherwise it waits for the launcher and exits with its status. SIGTERM / SIGINT sent to it go on
to the launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from types import FrameType

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int | bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children lists of every thread)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as fh:
                    children = [int(c) for c in fh.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def kill_all() -> None:
    """SIGKILL everything below this process, until nothing is left (a dying launcher may still fork)."""
    while True:
        below = descendants(os.getpid())
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap what died (orphans are ours: subreaper)
                pass
        except ChildProcessError:
            return


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m training.node.guard COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session's leader
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGHUP)

    def parent_died(signum: int, frame: FrameType | None) -> None:
        kill_all()
        os._exit(128 + signal.SIGKILL)

    signal.signal(signal.SIGHUP, parent_died)
    if os.getppid() != parent:  # it died before the death signal was armed
        return 128 + signal.SIGKILL
    launcher = subprocess.Popen(argv)

    def forward(signum: int, frame: FrameType | None) -> None:
        try:
            launcher.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:  # reap every child (adopted orphans included) until the launcher is done
        pid, status = os.waitpid(-1, 0)
        if pid == launcher.pid:
            code = os.waitstatus_to_exitcode(status)
            break
    kill_all()  # workers a dead launcher left behind
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
