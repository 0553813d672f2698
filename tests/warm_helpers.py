"""The warm-start tests' pieces (tests/test_warm.py, tests/test_warm_signals.py): a warm process
on a Unix socket preloading a small standard-library module instead of torch (its presence in a
job says "forked"), the client torchrun would start, and a job that reports what it was given."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "training/node/warm_client.py"
PRELOADED = "email.mime.text"  # not imported by a bare interpreter (-I -S): its presence says "forked"

JOB = textwrap.dedent("""
    import json, os, random, signal, subprocess, sys, time
    action = sys.argv[1] if len(sys.argv) > 1 else "0"
    if action == "unclosed":  # a module-level file never closed: the interpreter's finalisation flushes it
        leak = open(os.environ["GTS_TEST_OUT"] + ".unclosed", "w")
        leak.write("flushed at exit")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    report = {"argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgrp(), "cwd": os.getcwd(),
              "value": os.environ.get("GTS_TEST_VALUE"), "preloaded": %r in sys.modules,
              "random": random.random(), "path0": sys.path[0], "stdin": sys.stdin.readline().strip()}
    if action == "helper":  # a process in the job's group, as a data loader's workers are
        report["helper"] = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"]).pid
    if action == "linger":  # a forked process left behind, holding every descriptor the job had
        report["helper"] = os.fork() or time.sleep(600) or os._exit(0)
    report["odd"] = os.environ.get("GTS_TEST_ODD")
    out = os.environ["GTS_TEST_OUT"]
    with open(out + ".tmp", "w") as fh:
        json.dump(report, fh)
    os.replace(out + ".tmp", out)
    if action in ("wait", "helper"):
        signal.pause()
    if action == "gil":  # a native call that holds the GIL: no Python thread of the job runs
        import ctypes
        ctypes.PyDLL(None).sleep(600)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if action == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise ValueError("the job's own error")
    if action == "badhook":  # the job's own excepthook fails too
        def hook(*_):
            raise RuntimeError("the hook's own error")
        sys.excepthook = hook
        raise ValueError("the job's own error")
    if action == "linger":
        sys.exit(3)
    sys.exit(0 if action == "unclosed" else int(action))
""") % PRELOADED


@contextlib.contextmanager
def warm_process(tmp_path: Path, request_s: str = "1") -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A warm process listening on tmp/warm.sock; a client connecting before its preload is done
    waits in the backlog (the socket is bound first). Its own log: tmp/warm.log."""
    sock = tmp_path / "warm.sock"
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT), "GTS_WARM_REQUEST_S": request_s}
    with open(tmp_path / "warm.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "training.node.warm", "--socket", str(sock)], env=env,
                                cwd=ROOT, stderr=log)
    try:
        while not sock.exists():
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "warm.log").read_text())
            select.select([], [], [], 0.01)
        yield sock, proc
    finally:
        proc.kill()
        proc.wait()


def start_job(tmp_path: Path, sock: Path, *args: str, env: dict[str, str] | None = None,
         python_args: list[str] | None = None, stdin: str = "hello\n",
         affinity: set[int] | None = None) -> tuple[subprocess.Popen[str], Path]:
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    full = {**os.environ, "GTS_TEST_OUT": str(out), "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT),
            "GTS_WARM_SOCKET": str(sock), **(env or {})}
    cmd = [sys.executable, "-I", "-S", str(CLIENT),  # what warm-python runs
           *(python_args if python_args is not None else ["-u", str(tmp_path / "job.py")]), *args]
    proc = subprocess.Popen(cmd, env=full, cwd=tmp_path, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # as torchrun starts a worker
                            preexec_fn=(lambda: os.sched_setaffinity(0, affinity)) if affinity else None)
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc, out


def read_report(out: Path, proc: subprocess.Popen[str], timeout: float = 300) -> dict[str, object]:
    """The job's report once written; a job that ends without one, or hangs, fails the test."""
    deadline = time.monotonic() + timeout  # a bound on a hang, not a speed asserted
    while not out.exists():
        if proc.poll() is not None and not out.exists():
            raise AssertionError(proc.stderr.read() if proc.stderr else "no report")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no report from the job in {timeout} s")
        select.select([], [], [], 0.01)
    return dict(json.loads(out.read_text()))


def module_job(tmp_path: Path, sock: Path, action: str) -> tuple[subprocess.Popen[str], Path]:
    """The job as a module of a package in the working folder: `python -u -m jobpkg.run ACTION`."""
    (tmp_path / "jobpkg").mkdir()
    (tmp_path / "jobpkg" / "__init__.py").write_text("")
    (tmp_path / "jobpkg" / "run.py").write_text(JOB)
    return start_job(tmp_path, sock, action, python_args=["-u", "-m", "jobpkg.run"])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ended(pid: int, timeout: float = 120) -> bool:
    """Whether process `pid` ends within `timeout` (its pidfd becoming readable: an event)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


def raw(sock: Path, body: bytes, size: int | None = None) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(sock))
        socket.send_fds(raw, [struct.pack("!I", len(body) if size is None else size)], [0, 1, 2])
        raw.sendall(body)
        raw.shutdown(socket.SHUT_WR)
        try:
            return raw.recv(4096)
        except ConnectionResetError:
            return b""
