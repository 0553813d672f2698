"""What a launched run that does not end reports (tests/training_helpers.py Run.stacks): the
process that holds the run up comes first, with its Python stacks (and native ones where gdb is
installed), and the whole tree is gone afterwards. The case is the one CI met: a forked child,
single-threaded, waiting on a lock no thread of its own will release, under a parent that waits."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.training_helpers import FAULT_ENV, Run, _alive, descendants

TREE = """
import os, sys, threading, time

def hold_the_lock():
    lock = threading.Lock()
    lock.acquire()
    print("child", os.getpid(), "waits", flush=True)
    lock.acquire()

def wait_for_the_child(pid):
    os.waitpid(pid, 0)

pid = os.fork()
if pid == 0:
    hold_the_lock()
else:
    wait_for_the_child(pid)
"""


def test_a_hung_run_reports_the_waiting_child_first_then_is_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-u", "-c", TREE], env={**os.environ, **FAULT_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = Run(proc)
    run.start_reader()
    child = int(run.wait_for(r"^child \d+ waits$").split()[1])
    tree = [proc.pid, *descendants(proc.pid)]
    assert child in tree and len(tree) == 2

    with pytest.raises(AssertionError) as failure:
        run.finish(timeout=0.5)
    report = str(failure.value)

    sections = re.findall(r"^--- pid (\d+): (.*)$", report, re.M)
    assert [int(pid) for pid, _ in sections] == [child, proc.pid], report  # the lock's waiter first
    first = report.split(f"--- pid {proc.pid}:")[0]
    assert "hold_the_lock" in first and "wait_for_the_child" not in first, report
    assert "wait_for_the_child" in report.split(f"--- pid {proc.pid}:")[1], report
    if shutil.which("gdb"):
        assert re.search(r"sem_wait|futex|PyThread_acquire_lock", first), report
    assert not any(_alive(pid) for pid in tree)
    assert proc.returncode is not None
