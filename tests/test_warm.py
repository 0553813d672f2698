"""Warm worker starts (training/node/warm.py, warm_client.py) with real processes: a warm process
on a Unix socket, the client torchrun would start, and a job that reports what it was given. The
warm process here preloads a small standard-library module instead of torch, so the tests show
what a fork hands over (and what it must not) without torch's import time; the elastic tests run
the same path with torch, through torchrun (test_warm_torchrun below, and every rdzv_launch test)."""

from __future__ import annotations

import contextlib
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

from training.node import warm, warm_rules

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
    sys.exit(0 if action == "unclosed" else int(action))
""") % PRELOADED


@contextlib.contextmanager
def _warm(tmp_path: Path, request_s: str = "1") -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
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


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Path]:
    with _warm(tmp_path) as (sock, _):
        yield sock


def _job(tmp_path: Path, sock: Path, *args: str, env: dict[str, str] | None = None,
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


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ended(pid: int, timeout: float = 120) -> bool:
    """Whether process `pid` ends within `timeout` (its pidfd becoming readable: an event)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


def test_the_jobs_end_is_the_clients(tmp_path: Path, served: Path) -> None:
    killed, out = _job(tmp_path, served, "die")
    assert killed.wait(timeout=60) == -signal.SIGKILL  # a job killed by a signal: the client ends by it too
    assert _report(out, killed)["preloaded"] is True
    raised, out = _job(tmp_path, served, "raise")
    assert raised.wait(timeout=60) == 1  # an uncaught exception: 1 and its traceback, as python does
    assert raised.stderr is not None and "ValueError: the job's own error" in raised.stderr.read()
    assert _report(out, raised)["preloaded"] is True


def test_torchruns_signal_reaches_the_jobs_group_anothers_the_job_alone(tmp_path: Path, served: Path) -> None:
    """torchrun stops a worker with killpg (the client's parent: the job's whole group, as for a
    plain worker); the entrypoint's TERM and USR1 go to the worker alone (its data loaders'
    workers must not get them), and so they do through the client."""
    proc, out = _job(tmp_path, served, "helper")
    helper = int(_report(out, proc)["helper"])  # type: ignore[call-overload]
    try:
        subprocess.run(["kill", "-TERM", str(proc.pid)], check=True, timeout=60)  # not the client's parent
        assert proc.wait(timeout=60) == 7  # the job's handler ran
        assert _alive(helper), "a signal for the job alone reached its group"
    finally:
        os.kill(helper, signal.SIGKILL)
    proc, out = _job(tmp_path, served, "helper")
    helper = int(_report(out, proc)["helper"])  # type: ignore[call-overload]
    os.killpg(proc.pid, signal.SIGTERM)  # from the client's parent, as torchrun's SubprocessHandler.close
    assert proc.wait(timeout=60) == 7
    assert _ended(helper), "torchrun's signal did not reach the job's group"


def test_a_signal_sent_as_the_job_starts_is_not_lost(tmp_path: Path, served: Path) -> None:
    for _ in range(5):
        proc, _ = _job(tmp_path, served, "wait")
        os.kill(proc.pid, signal.SIGTERM)  # before the worker exists, or before its handler is set
        assert proc.wait(timeout=120) in (7, -signal.SIGTERM)  # it ends, one way or the other, never waits


@pytest.mark.parametrize("state", ["wait", "gil", "stop"])
def test_a_killed_client_takes_its_job_with_it(tmp_path: Path, served: Path, state: str) -> None:
    """Also a job in a native call that holds the GIL, or stopped: no thread of its own could act."""
    proc, out = _job(tmp_path, served, state)
    job = int(_report(out, proc)["pid"])  # type: ignore[call-overload]
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun's last resort: nothing runs in the client
    proc.wait(timeout=60)
    assert _ended(job), f"job {job} ({state}) outlived its client"


def test_the_jobs_exit_code_outlives_the_warm_process(tmp_path: Path) -> None:
    with _warm(tmp_path) as (sock, warm_proc):
        proc, out = _job(tmp_path, sock, "wait")
        assert _report(out, proc)["preloaded"] is True
        warm_proc.kill()
        warm_proc.wait()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 7  # the job's own word, not a failure made up


def test_a_module_level_file_left_open_is_flushed_at_exit(tmp_path: Path, served: Path) -> None:
    (tmp_path / "jobpkg").mkdir()
    (tmp_path / "jobpkg" / "__init__.py").write_text("")
    (tmp_path / "jobpkg" / "run.py").write_text(JOB)
    proc, out = _job(tmp_path, served, "unclosed", python_args=["-u", "-m", "jobpkg.run"])
    assert proc.wait(timeout=60) == 0
    assert _report(out, proc)["preloaded"] is True
    assert Path(str(out) + ".unclosed").read_text() == "flushed at exit"


def _raw(sock: Path, body: bytes, size: int | None = None) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(sock))
        socket.send_fds(raw, [struct.pack("!I", len(body) if size is None else size)], [0, 1, 2])
        raw.sendall(body)
        raw.shutdown(socket.SHUT_WR)
        try:
            return raw.recv(4096)
        except ConnectionResetError:
            return b""


def test_malformed_requests_are_refused_and_the_warm_process_serves_on(tmp_path: Path) -> None:
    with _warm(tmp_path) as (sock, warm_proc):
        good = {"args": ["-u", "job.py"], "env": {}, "cwd": str(tmp_path), "cpus": sorted(os.sched_getaffinity(0))}
        for body in (b"[]", json.dumps({**good, "env": {"A": 1}}).encode(), json.dumps({"args": []}).encode(),
                     b"\xff not json"):
            assert _raw(sock, body) == b""  # closed unanswered
        assert _raw(sock, b"{}", size=1 << 30) == b""  # a gigabyte announced: not read
        proc, out = _job(tmp_path, sock, "0")
        assert proc.wait(timeout=60) == 0 and _report(out, proc)["preloaded"] is True
        assert warm_proc.poll() is None
    assert (tmp_path / "warm.log").read_text().count("a request was refused") == 5


def test_a_request_whose_client_gave_up_is_not_forked(tmp_path: Path) -> None:
    with _warm(tmp_path, request_s="300") as (sock, _):
        (tmp_path / "job.py").write_text(JOB)
        first, out = _job(tmp_path, sock, "0")  # the warm process is ready once it has served one
        assert first.wait(timeout=60) == 0 and _report(out, first)["preloaded"] is True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(sock))  # holds the one serving loop while the next client comes and goes
            gone = tmp_path / "gone.json"
            body = json.dumps({"args": [str(tmp_path / "job.py"), "0"], "cwd": str(tmp_path),
                               "cpus": sorted(os.sched_getaffinity(0)),
                               "env": {**os.environ, "GTS_TEST_OUT": str(gone), "GTS_WARM_PRELOAD": PRELOADED,
                                       "PYTHONPATH": str(ROOT)}}).encode()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as quitter:
                quitter.connect(str(sock))
                socket.send_fds(quitter, [struct.pack("!I", len(body))], [0, 1, 2])
                quitter.sendall(body)
        last, out = _job(tmp_path, sock, "0")  # served after the one that gave up
        assert last.wait(timeout=60) == 0 and _report(out, last)["preloaded"] is True
        assert not gone.exists()  # no duplicate worker for a client that went cold


def test_a_client_that_never_sends_its_request_does_not_stall_the_others(tmp_path: Path, served: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(served))  # connected, nothing sent: the warm process gives up on it
        proc, out = _job(tmp_path, served, "0")
        assert proc.wait(timeout=120) == 0
        assert _report(out, proc)["preloaded"] is True  # served after it, warm
        assert silent.recv(16) == b""  # closed unanswered


@pytest.mark.parametrize("case", ["load-time setting differs", "no warm process", "arguments it does not take",
                                  "CPU affinity differs", "not a file", "not the launcher's warm process"])
def test_whatever_keeps_the_warm_start_from_serving_starts_the_job_cold(tmp_path: Path, served: Path, case: str) -> None:
    env: dict[str, str] = {}
    python_args, sock, affinity, stdin = None, served, None, "hello\n"
    (tmp_path / "job.py").write_text(JOB)
    if case == "load-time setting differs":
        env = {"PYTHONWARNINGS": "ignore"}
    elif case == "no warm process":
        sock = tmp_path / "absent.sock"
    elif case == "arguments it does not take":
        python_args = ["-u", "-W", "ignore", str(tmp_path / "job.py")]
    elif case == "CPU affinity differs":  # numactl / torchrun --numa-binding around the client
        if len(os.sched_getaffinity(0)) < 2:
            pytest.skip("one CPU: no other affinity to set")
        affinity = {min(os.sched_getaffinity(0))}
    elif case == "not a file":
        python_args, stdin = ["-u", "/dev/stdin"], JOB.replace('sys.stdin.readline().strip()', '""')
    else:
        env = {"GTS_WARM_PID": "1"}  # the socket's owner is another process (a squatter on a name left free)
    proc, out = _job(tmp_path, sock, "4", env=env, python_args=python_args, affinity=affinity, stdin=stdin)
    assert proc.wait(timeout=60) == 4  # the job ran all the same
    assert _report(out, proc)["preloaded"] is False  # as a fresh interpreter
    said = proc.stderr.read() if proc.stderr else ""
    assert "gts.warm: this worker starts cold" in said
    reason = {"load-time setting differs": "PYTHONWARNINGS differs from the warm process's",
              "CPU affinity differs": "CPU affinity differs", "not a file": "'/dev/stdin' is not a file",
              "not the launcher's warm process": "is not the launcher's warm process"}.get(case, "")
    assert reason in said


def test_which_settings_keep_a_fork_from_serving() -> None:
    mine = {"PYTHONPATH": "/opt/gts", "TORCHELASTIC_RESTART_COUNT": "0", "HOME": "/root"}
    assert warm_rules.differs(mine, {**mine, "TORCHELASTIC_RESTART_COUNT": "3", "RANK": "1", "OMP_NUM_THREADS": "1",
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HOME": "/tmp"}) == ""  # read at run time
    assert "PYTHONPATH" in warm_rules.differs(mine, {**mine, "PYTHONPATH": "/elsewhere"})
    assert "LD_PRELOAD" in warm_rules.differs(mine, {**mine, "LD_PRELOAD": "libjemalloc.so"})
    assert "TORCH_LOGS" in warm_rules.differs(mine, {**mine, "TORCH_LOGS": "+dynamo"})
    assert "OMP_NUM_THREADS" in warm_rules.differs({**mine, "OMP_NUM_THREADS": "4"}, mine)


def test_a_loaded_cuda_driver_turns_every_worker_cold(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert warm_rules.cuda_loaded(str(maps)) == ""
    maps.write_text(maps.read_text() + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert "CUDA driver was loaded" in warm_rules.cuda_loaded(str(maps))


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
