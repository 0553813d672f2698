"""Warm worker starts (training/node/warm.py, warm_client.py) with real processes: what a fork
hands over, what keeps a worker from being forked (each case starts it cold, and says why), who may
ask, and requests that are malformed, never finished or given up. The pieces: tests/warm_helpers.py;
signals and ends: tests/test_warm_signals.py; through torchrun: tests/test_warm_torchrun.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.node import warm_launch, warm_rules
from tests.warm_helpers import ROOT, PRELOADED, JOB, warm_process, start_job, read_report, module_job, raw


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Path]:
    with warm_process(tmp_path) as (sock, _):
        yield sock


def test_a_forked_job_gets_the_clients_arguments_environment_folder_and_streams(tmp_path: Path, served: Path) -> None:
    proc, out = start_job(tmp_path, served, "3", env={"GTS_TEST_VALUE": "from the client"})
    assert proc.wait(timeout=60) == 3  # its exit code, through the client
    report = read_report(out, proc)
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
        proc, out = start_job(tmp_path, served)
        assert proc.wait(timeout=60) == 0
        reports.append(read_report(out, proc))
    assert all(r["preloaded"] for r in reports)
    assert reports[0]["random"] != reports[1]["random"]


def test_a_module_runs_as_python_dash_m_would(tmp_path: Path, served: Path) -> None:
    proc, out = module_job(tmp_path, served, "5")
    assert proc.wait(timeout=60) == 5
    report = read_report(out, proc)
    assert report["preloaded"] is True
    assert report["argv"] == [str(tmp_path / "jobpkg" / "run.py"), "5"]  # argv[0] the module's file, as -m sets it
    assert report["path0"] == str(tmp_path)  # the working folder first on sys.path, as -m puts it


def test_an_environment_with_undecodable_bytes_is_handed_over_as_it_is(tmp_path: Path, served: Path) -> None:
    proc, out = start_job(tmp_path, served, "0", env={"GTS_TEST_ODD": "caf\udce9"})  # b"caf\xe9" in the process
    assert proc.wait(timeout=60) == 0
    report = read_report(out, proc)
    assert report["preloaded"] is True and report["odd"] == "caf\udce9"


def test_malformed_requests_are_refused_and_the_warm_process_serves_on(tmp_path: Path) -> None:
    with warm_process(tmp_path) as (sock, warm_proc):
        good = {"args": ["-u", "job.py"], "env": {}, "cwd": str(tmp_path), "cpus": sorted(os.sched_getaffinity(0))}
        for body in (b"[]", json.dumps({**good, "env": {"A": 1}}).encode(), json.dumps({"args": []}).encode(),
                     b"\xff not json"):
            assert raw(sock, body).startswith(b'{"cold": "the warm process refused the request')  # said why
        assert b"refused the request" in raw(sock, b"{}", size=1 << 30)  # a gigabyte announced: not read
        proc, out = start_job(tmp_path, sock, "0")
        assert proc.wait(timeout=60) == 0 and read_report(out, proc)["preloaded"] is True
        assert warm_proc.poll() is None
    assert (tmp_path / "warm.log").read_text().count("a request was refused") == 5


def test_a_request_whose_client_gave_up_is_not_forked(tmp_path: Path) -> None:
    with warm_process(tmp_path, request_s="300") as (sock, _):
        (tmp_path / "job.py").write_text(JOB)
        first, out = start_job(tmp_path, sock, "0")  # the warm process is ready once it has served one
        assert first.wait(timeout=60) == 0 and read_report(out, first)["preloaded"] is True
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
        last, out = start_job(tmp_path, sock, "0")  # served after the one that gave up
        assert last.wait(timeout=60) == 0 and read_report(out, last)["preloaded"] is True
        assert not gone.exists()  # no duplicate worker for a client that went cold


def test_a_client_that_never_sends_its_request_does_not_stall_the_others(tmp_path: Path, served: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(served))  # connected, nothing sent: the warm process gives up on it
        proc, out = start_job(tmp_path, served, "0")
        assert proc.wait(timeout=120) == 0
        assert read_report(out, proc)["preloaded"] is True  # served after it, warm
        assert silent.recv(4096).startswith(b'{"cold": "the warm process refused the request (timed out)')


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
    proc, out = start_job(tmp_path, sock, "4", env=env, python_args=python_args, affinity=affinity, stdin=stdin)
    assert proc.wait(timeout=60) == 4  # the job ran all the same
    assert read_report(out, proc)["preloaded"] is False  # as a fresh interpreter
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
    started = warm_launch.start(no_python=False, env=env)
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
    assert warm_launch.start(no_python=True, env={}) is None
    assert warm_launch.start(no_python=False, env={"GTS_WARM_WORKERS": "0"}) is None
    assert warm_launch.start(no_python=False, env={"PYTHON_EXEC": "/usr/bin/python3"}) is None
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT)}
    started = warm_launch.start(no_python=False, env=env)
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


def test_the_socket_file_appears_only_once_it_listens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client (or a test) that finds the socket file is never refused: the file is linked into
    place once the socket listens; a path in use is refused as bind refuses it, and left alone."""
    path = str(tmp_path / "warm.sock")
    chmod = os.chmod
    seen: list[bool] = []

    def spy(target: str, mode: int) -> None:  # between the bind and the listen
        seen.append(os.path.exists(path))
        chmod(target, mode)

    monkeypatch.setattr(os, "chmod", spy)
    with warm_launch.listen(path) as listener:
        assert seen == [False]  # not there while it could still refuse
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.listdir(tmp_path) == ["warm.sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)
            listener.accept()[0].close()
        before = os.stat(path).st_ino
        with pytest.raises(OSError, match="Address already in use"):
            warm_launch.listen(path)
        assert os.stat(path).st_ino == before and os.listdir(tmp_path) == ["warm.sock"]
