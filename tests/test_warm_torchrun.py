"""Warm worker starts through the real launcher (training/node/rdzv_launch.py, torchrun 2.13): a
one-node elastic run of two workers whose first attempt fails, so torchrun restarts it. Each
worker reports, before it imports anything, whether torch was already in the interpreter (it was
forked from the node's warm process), which process is its parent, and then meets the other
worker in a gloo process group; the restart's workers are forked too; the warm process is not
among the launcher's workers the entrypoint signals, and it is gone when the launcher ends."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.rdzv_helpers import tcp_store
from tests.training_helpers import RDZV_TEST_KEY, ROOT

JOB = textwrap.dedent("""
    import json, os, sys
    forked = "torch" in sys.modules  # before this job imports anything
    parent = open(f"/proc/{os.getppid()}/comm").read().strip()
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    report = {"forked": forked, "parent": parent, "sum": total.item(), "threads": torch.get_num_threads(),
              "pid": os.getpid(), "ppid": os.getppid()}
    with open(os.path.join(os.environ["GTS_TEST_DIR"], f"r{attempt}-{dist.get_rank()}.json"), "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()
    sys.exit(3 if attempt == "0" else 0)  # the first attempt fails: torchrun restarts the workers
""")


def test_torchrun_forks_each_attempts_workers_from_the_warm_process(tmp_path: Path) -> None:
    store = tcp_store()
    (tmp_path / "job.py").write_text(JOB)
    env = {**os.environ, "RDZV_KEY": RDZV_TEST_KEY, "GTS_TEST_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("PYTHON_EXEC", None)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per worker (two workers): applied in the fork
    cmd = [sys.executable, "-m", "training.node.rdzv_launch", "--nnodes", "1:1", "--nproc-per-node", "2",
           "--rdzv-backend", "gts-c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "warm-test",
           "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1", "--max-restarts", "1", "--monitor-interval", "0.1",
           str(tmp_path / "job.py")]
    launcher = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = launcher.stdout + launcher.stderr
    assert launcher.returncode == 0, said[-4000:]
    assert "starts cold" not in said, said[-4000:]
    reports = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("r*-*.json")}
    assert sorted(reports) == ["r0-0", "r0-1", "r1-0", "r1-1"], said[-4000:]
    for name, report in reports.items():
        assert report["forked"] is True and report["parent"] == "gts-warm", (name, report)
        assert report["sum"] == 3.0  # the two workers met in one gloo group
        assert report["threads"] == 1, report  # torchrun's OMP_NUM_THREADS=1, applied after the fork
    assert len({r["pid"] for r in reports.values()}) == 4
    warm = {r["ppid"] for r in reports.values()}
    assert len(warm) == 1  # one warm process for the node, both attempts
    try:  # the launcher's exit took its warm process with it
        pidfd = os.pidfd_open(warm.pop())
    except ProcessLookupError:
        return
    try:
        assert select.select([pidfd], [], [], 60)[0], "the warm process outlived its launcher"
    finally:
        os.close(pidfd)
