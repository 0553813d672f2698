"""Warm worker starts (training/node/warm.py, warm_client.py) with real processes: a warm process
on a Unix socket, the client torchrun would start, and a job that reports what it was given. The
warm process here preloads a small standard-library module instead of torch, so the tests show
what a fork hands over (and what it must not) without torch's import time; the elastic tests run
the same path with torch, through torchrun (test_warm_torchrun below, and every rdzv_launch test)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.node import warm

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "training/node/warm_client.py"
PRELOADED = "email.mime.text"  # not imported by a bare interpreter (-I -S): its presence says "forked"

JOB = textwrap.dedent("""
    import json, os, random, signal, sys, time
    report = {"argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgrp(), "cwd": os.getcwd(),
              "value": os.environ.get("GTS_TEST_VALUE"), "preloaded": %r in sys.modules,
              "random": random.random(), "path0": sys.path[0], "stdin": sys.stdin.readline().strip()}
    out = os.environ["GTS_TEST_OUT"]
    with open(out + ".tmp", "w") as fh:
        json.dump(report, fh)
    os.replace(out + ".tmp", out)
    action = sys.argv[1] if len(sys.argv) > 1 else "0"
    if action == "wait":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        signal.pause()
    if action == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise ValueError("the job's own error")
    sys.exit(int(action))
""") % PRELOADED


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Path]:
    """A warm process listening on tmp/warm.sock, ready (a first job has been forked by it)."""
    sock = tmp_path / "warm.sock"
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT), "GTS_WARM_REQUEST_S": "1"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "training.node.warm", "--socket", str(sock)], env=env,
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        while not sock.exists():  # bound before the preload; a client connecting early waits in the backlog
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read() if proc.stderr else "the warm process ended")
            select.select([], [], [], 0.01)
        yield sock
    finally:
        proc.kill()
        proc.wait()


def _job(tmp_path: Path, sock: Path, *args: str, env: dict[str, str] | None = None,
         python_args: list[str] | None = None, stdin: str = "hello\n") -> tuple[subprocess.Popen[str], Path]:
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    full = {**os.environ, "GTS_TEST_OUT": str(out), "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT),
            "GTS_WARM_SOCKET": str(sock), **(env or {})}
    cmd = [sys.executable, "-I", "-S", str(CLIENT),  # what warm-python runs
           *(python_args if python_args is not None else ["-u", str(tmp_path / "job.py")]), *args]
    proc = subprocess.Popen(cmd, env=full, cwd=tmp_path, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # as torchrun starts a worker
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc, out


def _report(out: Path, proc: subprocess.Popen[str]) -> dict[str, object]:
    while not out.exists():
        if proc.poll() is not None and not out.exists():
            raise AssertionError(proc.stderr.read() if proc.stderr else "no report")
        select.select([], [], [], 0.01)
    return dict(json.loads(out.read_text()))


def test_a_forked_job_gets_the_clients_arguments_environment_folder_and_streams(tmp_path: Path, served: Path) -> None:
    proc, out = _job(tmp_path, served, "3", env={"GTS_TEST_VALUE": "from the client"})
    assert proc.wait(timeout=60) == 3  # its exit code, through the client
    report = _report(out, proc)
    assert report["preloaded"] is True, "the job was not forked from the warm process"
    assert report["argv"] == [str(tmp_path / "job.py"), "3"]
    assert report["value"] == "from the client" and report["cwd"] == str(tmp_path)
    assert report["stdin"] == "hello"  # the client's stdin, passed over the socket
    assert report["pgid"] == report["pid"] != proc.pid  # a group of its own, which the client signals
    assert report["path0"] == str(tmp_path)  # the script's folder first on sys.path, as `python SCRIPT`
    assert "starts cold" not in (proc.stderr.read() if proc.stderr else "")


def test_two_forked_jobs_do_not_share_their_random_state(tmp_path: Path, served: Path) -> None:
    reports = []
    for _ in range(2):
        proc, out = _job(tmp_path, served)
        assert proc.wait(timeout=60) == 0
        reports.append(_report(out, proc))
    assert all(r["preloaded"] for r in reports)
    assert reports[0]["random"] != reports[1]["random"]


def test_a_module_runs_as_python_dash_m_would(tmp_path: Path, served: Path) -> None:
    (tmp_path / "jobpkg").mkdir()
    (tmp_path / "jobpkg" / "__init__.py").write_text("")
    (tmp_path / "jobpkg" / "run.py").write_text(JOB)
    proc, out = _job(tmp_path, served, "5", python_args=["-u", "-m", "jobpkg.run"])
    assert proc.wait(timeout=60) == 5
    report = _report(out, proc)
    assert report["preloaded"] is True
    assert report["argv"] == [str(tmp_path / "jobpkg" / "run.py"), "5"]  # argv[0] the module's file, as -m sets it
    assert report["path0"] == str(tmp_path)  # the working folder first on sys.path, as -m puts it


def test_a_signal_to_the_client_reaches_the_job_and_its_end_is_the_clients(tmp_path: Path, served: Path) -> None:
    proc, out = _job(tmp_path, served, "wait")
    report = _report(out, proc)
    os.killpg(proc.pid, signal.SIGTERM)  # what torchrun does to stop a worker: its session's group
    assert proc.wait(timeout=60) == 7  # the job's handler ran (sys.exit(7))
    killed, out2 = _job(tmp_path, served, "die")
    assert killed.wait(timeout=60) == -signal.SIGKILL  # a job killed by a signal: the client ends by it too
    assert _report(out2, killed)["preloaded"] is True
    assert report["preloaded"] is True
    raised, out3 = _job(tmp_path, served, "raise")
    assert raised.wait(timeout=60) == 1  # an uncaught exception: 1 and its traceback, as python does
    assert raised.stderr is not None and "ValueError: the job's own error" in raised.stderr.read()


def test_a_killed_client_takes_its_job_with_it(tmp_path: Path, served: Path) -> None:
    proc, out = _job(tmp_path, served, "wait")
    job = int(_report(out, proc)["pid"])  # type: ignore[call-overload]
    pidfd = os.pidfd_open(job)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's last resort: nothing runs in the client
        proc.wait(timeout=60)
        ready, _, _ = select.select([pidfd], [], [], 120)  # the job's end, as an event
        assert ready, f"job {job} outlived its client"
    finally:
        os.close(pidfd)


def test_a_client_that_never_sends_its_request_does_not_stall_the_others(tmp_path: Path, served: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(served))  # connected, nothing sent: the warm process gives up on it
        proc, out = _job(tmp_path, served, "0")
        assert proc.wait(timeout=120) == 0
        assert _report(out, proc)["preloaded"] is True  # served after it, warm
        assert silent.recv(16) == b""  # closed unanswered


@pytest.mark.parametrize("case", ["load-time setting differs", "no warm process", "arguments it does not take"])
def test_whatever_keeps_the_warm_start_from_serving_starts_the_job_cold(tmp_path: Path, served: Path, case: str) -> None:
    env, python_args, sock = {}, None, served
    if case == "load-time setting differs":
        env = {"PYTHONWARNINGS": "ignore"}
    elif case == "no warm process":
        sock = tmp_path / "absent.sock"
    else:
        (tmp_path / "job.py").write_text(JOB)
        python_args = ["-u", "-W", "ignore", str(tmp_path / "job.py")]
    proc, out = _job(tmp_path, sock, "4", env=env, python_args=python_args)
    assert proc.wait(timeout=60) == 4  # the job ran all the same
    assert _report(out, proc)["preloaded"] is False  # as a fresh interpreter
    said = proc.stderr.read() if proc.stderr else ""
    assert "gts.warm: this worker starts cold" in said
    if case == "load-time setting differs":
        assert "PYTHONWARNINGS differs from the warm process's" in said


def test_which_settings_keep_a_fork_from_serving() -> None:
    mine = {"PYTHONPATH": "/opt/gts", "TORCHELASTIC_RESTART_COUNT": "0", "HOME": "/root"}
    assert warm.differs(mine, {**mine, "TORCHELASTIC_RESTART_COUNT": "3", "RANK": "1", "OMP_NUM_THREADS": "1",
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HOME": "/tmp"}) == ""  # read at run time
    assert "PYTHONPATH" in warm.differs(mine, {**mine, "PYTHONPATH": "/elsewhere"})
    assert "LD_PRELOAD" in warm.differs(mine, {**mine, "LD_PRELOAD": "libjemalloc.so"})
    assert "TORCH_LOGS" in warm.differs(mine, {**mine, "TORCH_LOGS": "+dynamo"})
    assert "OMP_NUM_THREADS" in warm.differs({**mine, "OMP_NUM_THREADS": "4"}, mine)


def test_a_loaded_cuda_driver_turns_every_worker_cold(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert warm.cuda_loaded(str(maps)) == ""
    maps.write_text(maps.read_text() + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert "CUDA driver was loaded" in warm.cuda_loaded(str(maps))


def test_a_client_of_another_user_is_refused() -> None:
    """The launcher's socket is an abstract name, which any uid in the network namespace can
    reach: a process of another uid gets no fork, and no answer."""
    if os.getuid() != 0:
        pytest.skip("needs root to become another user")
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT)}
    started = warm.start(no_python=False, env=env)
    assert started is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: a raw request, as warm_client.py sends it
        answer = b"?"
        try:
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect("\0" + env["GTS_WARM_SOCKET"])
                body = json.dumps({"args": ["-c", "pass"], "env": {}, "cwd": "/"}).encode()
                socket.send_fds(sock, [struct.pack("!I", len(body))], [0, 1, 2])
                sock.sendall(body)
                answer = sock.recv(4096) or b"closed"
        except ConnectionResetError:  # closed with the request unread
            answer = b"closed"
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            answer = repr(exc).encode()
        os.write(write, answer)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    started.kill()
    started.wait()
    with os.fdopen(read, "rb") as fh:
        assert fh.read() == b"closed"  # no pid, no "cold": the connection closed unanswered


def test_the_launcher_starts_it_only_for_python_workers_without_a_python_exec_of_their_own(tmp_path: Path) -> None:
    assert warm.start(no_python=True, env={}) is None
    assert warm.start(no_python=False, env={"GTS_WARM_WORKERS": "0"}) is None
    assert warm.start(no_python=False, env={"PYTHON_EXEC": "/usr/bin/python3"}) is None
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT)}
    started = warm.start(no_python=False, env=env)
    assert started is not None
    try:
        assert env["PYTHON_EXEC"] == str(ROOT / "training/node/warm-python")
        assert not env["GTS_WARM_SOCKET"].startswith("/")  # abstract: nothing left on disk after a kill
        (tmp_path / "job.py").write_text(JOB)
        out = tmp_path / "report.json"
        job = subprocess.run([env["PYTHON_EXEC"], "-u", str(tmp_path / "job.py"), "2"],
                             env={**env, "GTS_TEST_OUT": str(out)}, cwd=tmp_path, input="x\n", text=True, timeout=120)
        assert job.returncode == 2
        assert json.loads(out.read_text())["preloaded"] is True
    finally:
        started.kill()
        started.wait()


def test_the_wrapper_passes_shellcheck_and_is_executable() -> None:
    wrapper = ROOT / "training/node/warm-python"
    assert os.access(wrapper, os.X_OK)
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([shellcheck, "-s", "sh", str(wrapper)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
