"""Issue 46: a worker whose collective broke because a peer's process is gone leaves at once
(training/trainer/failure.py leave_now): its fault noted, its traceback printed, its threads
joined and exit handlers run as the interpreter would, and the interpreter's finalisation (where
the broken process group's teardown held it) skipped; any other error takes the usual exit.
Real processes: two gloo ranks, one SIGKILLed after their first all-reduce (for the other
error it stays until the first has gone: with it dead, that exit's teardown aborted at times)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training.trainer import failure

ROOT = Path(__file__).resolve().parents[1]

# rank 0 goes through failure.noted, as the trainer's `python -m` entry does; its marks say which
# steps of an exit ran: a pool's job and a non-daemon thread (joined at exit), an atexit handler,
# and a global's __del__ (the interpreter's finalisation, which the fast exit skips)
RANK = textwrap.dedent("""
    import atexit, ctypes, os, signal, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    import torch, torch.distributed as dist
    from training.trainer import failure
    rank, port, marks, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    def mark(what):
        with open(marks, "a") as fh:
            fh.write(what + "\\n")
    class Finalised:  # its own references: module globals may be gone when it runs
        def __del__(self, marks=marks, open=open):
            with open(marks, "a") as fh:
                fh.write("finalised\\n")
    kept = Finalised()
    failing = threading.Event()
    def main():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        dist.all_reduce(torch.ones(4))
        if rank == 1 and fault == "other":  # alive until rank 0 has gone (a dead peer made its usual exit's
            try:                               # teardown abort at times: SIGABRT, not the exit under test)
                dist.all_reduce(torch.ones(1))
            except Exception:
                pass
            os._exit(0)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost node: no exit of its own
        atexit.register(mark, "atexit")
        ctypes.CDLL(None).printf(b"a native line\\n")  # held in C's stdout buffer (a pipe)
        threading.Thread(target=lambda: (failing.wait(), mark("thread"))).start()
        ThreadPoolExecutor(1).submit(lambda: (failing.wait(), mark("pool")))
        try:
            if fault == "other":
                raise ValueError("a bad setting")
            while True:
                dist.all_reduce(torch.ones(1 << 20))
        finally:
            failing.set()
    sys.exit(failure.noted(main))
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("fault", ["peer gone", "other"])
def test_a_worker_whose_peer_is_gone_exits_without_finalisation(tmp_path: Path, fault: str) -> None:
    port, marks, script = _port(), tmp_path / "marks", tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # C's stdout buffered, as in an image
           "PYTHONPATH": str(ROOT), "GTS_FAILURE_FILE": str(tmp_path / "failure"), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(marks), fault], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    out, err = ranks[0].communicate(timeout=300)
    ranks[1].communicate(timeout=300)
    assert ranks[0].returncode == 1, err[-3000:]
    assert "a native line" in out  # C's buffers flushed on either exit
    done = marks.read_text().split()
    assert {"thread", "pool", "atexit"} <= set(done), done
    noted = (tmp_path / "failure").read_text()
    if fault == "peer gone":
        assert "finalised" not in done, done  # the interpreter's finalisation skipped
        assert "RuntimeError" in noted and "Traceback (most recent call last)" in err and "gloo" in err
    else:
        assert "finalised" in done, done  # the usual exit, finalisation included
        assert "ValueError: a bad setting" in noted and "Traceback (most recent call last)" in err


@pytest.mark.parametrize("text, gone", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:39813: Connection reset by peer",
     True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7888", True),
    ("CUDA out of memory", False),
    ("Connection reset by peer", False),  # not from the collectives' transport: e.g. an HTTP client's
])
def test_what_counts_as_a_peer_gone(text: str, gone: bool) -> None:
    assert failure.peer_gone(RuntimeError(text)) is gone


def test_torch_s_distributed_errors_count_and_other_errors_do_not() -> None:
    import torch.distributed as dist

    assert failure.peer_gone(dist.DistBackendError("NCCL communicator was aborted"))
    assert failure.peer_gone(dist.DistNetworkError("connection lost"))
    assert not failure.peer_gone(ValueError("gloo/transport/ Connection reset by peer"))
