"""Warm worker starts (training/node/warm.py, warm_client.py): the client stands in for its
worker towards torchrun. Signals from torchrun and from others, one sent as the worker starts, a
SIGKILLed client (its worker waiting, holding the GIL, stopped), the worker's end as the client's
(exit code, signal, an uncaught error, a failing excepthook), a process the worker left behind,
the warm process killed under a running worker, finalisation. The pieces: tests/warm_helpers.py."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.warm_helpers import PRELOADED, ROOT, warm_process, start_job, read_report, module_job, alive, ended


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Path]:
    with warm_process(tmp_path) as (sock, _):
        yield sock


def test_the_jobs_end_is_the_clients(tmp_path: Path, served: Path) -> None:
    killed, out = start_job(tmp_path, served, "die")
    assert killed.wait(timeout=60) == -signal.SIGKILL  # a job killed by a signal: the client ends by it too
    assert read_report(out, killed)["preloaded"] is True
    raised, out = start_job(tmp_path, served, "raise")
    assert raised.wait(timeout=60) == 1  # an uncaught exception: 1 and its traceback, as python does
    assert raised.stderr is not None and "ValueError: the job's own error" in raised.stderr.read()
    assert read_report(out, raised)["preloaded"] is True


def test_a_forked_process_left_behind_does_not_hold_the_clients_end(tmp_path: Path, served: Path) -> None:
    proc, out = start_job(tmp_path, served, "linger")
    helper = int(read_report(out, proc)["helper"])  # type: ignore[call-overload]
    try:
        assert proc.wait(timeout=60) == 3  # the job's end, though its helper still holds the connection
        assert alive(helper)
    finally:
        os.kill(helper, signal.SIGKILL)


def test_a_job_whose_excepthook_fails_never_serves(tmp_path: Path) -> None:
    with warm_process(tmp_path) as (sock, warm_proc):
        proc, out = start_job(tmp_path, sock, "badhook")
        assert proc.wait(timeout=60) == 1
        assert read_report(out, proc)["preloaded"] is True
        again, out = start_job(tmp_path, sock, "0")
        assert again.wait(timeout=60) == 0 and read_report(out, again)["preloaded"] is True
        assert warm_proc.poll() is None
    assert "a request failed" not in (tmp_path / "warm.log").read_text()  # the job never ran the serving loop


def test_quick_jobs_run_once_each(tmp_path: Path, served: Path) -> None:
    """A job that ends at once reports before the warm process has answered its client: it must
    not be taken for a refusal and run again, cold (the child waits for its client to know it)."""
    for _ in range(10):
        proc, out = start_job(tmp_path, served, "3")
        assert proc.wait(timeout=60) == 3
        assert read_report(out, proc)["preloaded"] is True
        assert "starts cold" not in (proc.stderr.read() if proc.stderr else "")


def test_torchruns_signal_reaches_the_jobs_group_anothers_the_job_alone(tmp_path: Path, served: Path) -> None:
    """torchrun stops a worker with killpg (the client's parent: the job's whole group, as for a
    plain worker); the entrypoint's TERM and USR1 go to the worker alone (its data loaders'
    workers must not get them), and so they do through the client."""
    proc, out = start_job(tmp_path, served, "helper")
    helper = int(read_report(out, proc)["helper"])  # type: ignore[call-overload]
    try:
        subprocess.run(["kill", "-TERM", str(proc.pid)], check=True, timeout=60)  # not the client's parent
        assert proc.wait(timeout=60) == 7  # the job's handler ran
        assert alive(helper), "a signal for the job alone reached its group"
    finally:
        os.kill(helper, signal.SIGKILL)
    proc, out = start_job(tmp_path, served, "helper")
    helper = int(read_report(out, proc)["helper"])  # type: ignore[call-overload]
    os.killpg(proc.pid, signal.SIGTERM)  # from the client's parent, as torchrun's SubprocessHandler.close
    assert proc.wait(timeout=60) == 7
    assert ended(helper), "torchrun's signal did not reach the job's group"


def test_a_signal_sent_as_the_job_starts_is_not_lost(tmp_path: Path, served: Path) -> None:
    for _ in range(5):
        proc, _ = start_job(tmp_path, served, "wait")
        os.kill(proc.pid, signal.SIGTERM)  # before the worker exists, or before its handler is set
        assert proc.wait(timeout=120) in (7, -signal.SIGTERM)  # it ends, one way or the other, never waits


@pytest.mark.parametrize("state", ["wait", "gil", "stop"])
def test_a_killed_client_takes_its_job_with_it(tmp_path: Path, served: Path, state: str) -> None:
    """Also a job in a native call that holds the GIL, or stopped: no thread of its own could act."""
    proc, out = start_job(tmp_path, served, state)
    job = int(read_report(out, proc)["pid"])  # type: ignore[call-overload]
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun's last resort: nothing runs in the client
    proc.wait(timeout=60)
    assert ended(job), f"job {job} ({state}) outlived its client"


def test_the_jobs_exit_code_outlives_the_warm_process(tmp_path: Path) -> None:
    with warm_process(tmp_path) as (sock, warm_proc):
        proc, out = start_job(tmp_path, sock, "wait")
        assert read_report(out, proc)["preloaded"] is True
        warm_proc.kill()
        warm_proc.wait()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 7  # the job's own word, not a failure made up


def test_a_module_level_file_left_open_is_flushed_at_exit(tmp_path: Path, served: Path) -> None:
    proc, out = module_job(tmp_path, served, "unclosed")
    assert proc.wait(timeout=60) == 0
    assert read_report(out, proc)["preloaded"] is True
    assert Path(str(out) + ".unclosed").read_text() == "flushed at exit"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_warm_process_started_by_hand_stops_on_ctrl_c_and_term_and_its_job_runs_on(tmp_path: Path,
                                                                                     sig: signal.Signals) -> None:
    with warm_process(tmp_path) as (sock, warm_proc):
        proc, out = start_job(tmp_path, sock, "wait")
        job = int(read_report(out, proc)["pid"])  # type: ignore[call-overload]
        warm_proc.send_signal(sig)  # Ctrl-C in its terminal, or a service manager's stop
        assert warm_proc.wait(timeout=60) == -sig  # it ends by that signal, as a shell expects
        assert not sock.exists()  # its socket path goes with it
        assert alive(job)  # a running job is not the warm process's to end
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 7  # and its end is still its client's
    assert f"gts.warm: stopped by {sig.name}" in (tmp_path / "warm.log").read_text()


def test_a_stop_during_a_request_waits_for_the_request_to_be_done(tmp_path: Path) -> None:
    """The stop comes while the warm process hands a worker its pid: the worker still runs (never
    a worker its client knows that never ran), then the warm process stops."""
    hook = tmp_path / "sitecustomize.py"  # in the warm process only: a stop sent to itself mid-request
    hook.write_text("import os, signal\nfrom training.node import warm\nstarted = warm.Warm._started\n"
                    "def _started(self, pid, conn):\n    started(self, pid, conn)\n"
                    "    os.kill(os.getpid(), signal.SIGTERM)\nwarm.Warm._started = _started\n")
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    sock = tmp_path / "warm.sock"
    warm_proc = subprocess.Popen([sys.executable, "-u", "-c", "import sitecustomize; from training.node import warm; "
                                  f"warm.main(['--socket', {str(sock)!r}])"], env=env, cwd=ROOT)
    try:
        while not sock.exists():
            assert warm_proc.poll() is None
            select.select([], [], [], 0.01)
        proc, out = start_job(tmp_path, sock, "0", env={"PYTHONPATH": env["PYTHONPATH"]})  # as the warm process's
        assert proc.wait(timeout=120) == 0 and read_report(out, proc)["preloaded"] is True  # forked, and it ran
        assert warm_proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        warm_proc.kill()
        warm_proc.wait()


def test_a_warm_process_leaves_a_socket_path_it_could_not_take_alone(tmp_path: Path) -> None:
    with warm_process(tmp_path) as (sock, warm_proc):
        second = subprocess.run([sys.executable, "-m", "training.node.warm", "--socket", str(sock)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and "Address already in use" in second.stderr
        assert sock.exists()  # the first one's socket is still there, and serves
        proc, out = start_job(tmp_path, sock, "0")
        assert proc.wait(timeout=120) == 0 and read_report(out, proc)["preloaded"] is True


def test_a_warm_process_started_with_hangup_ignored_keeps_it_ignored(tmp_path: Path) -> None:
    """As under nohup: HUP was ignored when it started, so HUP does not stop it; TERM still does."""
    sock = tmp_path / "warm.sock"
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT)}
    warm_proc = subprocess.Popen([sys.executable, "-u", "-m", "training.node.warm", "--socket", str(sock)], env=env,
                                 cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        while not sock.exists():
            assert warm_proc.poll() is None
            select.select([], [], [], 0.01)
        proc, out = start_job(tmp_path, sock, "0")  # served: its handlers are in place
        assert proc.wait(timeout=120) == 0 and read_report(out, proc)["preloaded"] is True
        warm_proc.send_signal(signal.SIGHUP)
        proc, out = start_job(tmp_path, sock, "0")
        assert proc.wait(timeout=120) == 0 and read_report(out, proc)["preloaded"] is True
        warm_proc.send_signal(signal.SIGTERM)
        assert warm_proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        warm_proc.kill()
        warm_proc.wait()


def test_a_warm_process_the_launcher_started_ignores_the_terminals_signals(tmp_path: Path) -> None:
    """Started with --fd (the launcher's), it ends with the launcher only: a Ctrl-C to the
    launcher's process group is torchrun's to handle, and workers it starts meanwhile are forked."""
    from training.node.warm_launch import listen
    sock = tmp_path / "launcher.sock"
    env = {**os.environ, "GTS_WARM_PRELOAD": PRELOADED, "PYTHONPATH": str(ROOT)}
    with listen(str(sock)) as listener:
        warm_proc = subprocess.Popen([sys.executable, "-u", "-m", "training.node.warm", "--fd", str(listener.fileno())],
                                     env=env, cwd=ROOT, pass_fds=[listener.fileno()])
    try:
        proc, out = start_job(tmp_path, sock, "0")  # served: it is up, its signals blocked
        assert proc.wait(timeout=120) == 0 and read_report(out, proc)["preloaded"] is True
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            warm_proc.send_signal(sig)
        proc, out = start_job(tmp_path, sock, "0")  # served after all three
        assert proc.wait(timeout=120) == 0 and read_report(out, proc)["preloaded"] is True
        assert warm_proc.poll() is None
    finally:
        warm_proc.kill()
        warm_proc.wait()
