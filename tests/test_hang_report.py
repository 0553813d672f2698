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

    headers = list(re.finditer(r"^--- pid (\d+): .*$", report, re.M))
    assert [int(h.group(1)) for h in headers] == [child, proc.pid], report  # the lock's waiter first
    body = {int(h.group(1)): report[h.end():nxt.start() if nxt else len(report)]  # below each header
            for h, nxt in zip(headers, [*headers[1:], None])}
    assert re.search(r'File "<string>", line \d+ in hold_the_lock$', body[child], re.M), report  # faulthandler's
    assert re.search(r'File "<string>", line \d+ in wait_for_the_child$', body[proc.pid], re.M), report
    assert "wait_for_the_child" not in body[child] and "hold_the_lock" not in body[proc.pid], report
    if shutil.which("gdb"):
        assert re.search(r"__new_sem_wait|PyThread_acquire_lock", body[child]), report  # gdb's frames
    assert not any(_alive(pid) for pid in tree)
    assert proc.returncode is not None
