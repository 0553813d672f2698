"""Multi-node training that survives losing a node: three local "nodes" (each the image's
entrypoint with its own torchrun and its own scratch), one rendezvous store apart from them
(training/rdzv_store.py, as the stack runs it), checkpoints in one S3 bucket on 127.0.0.1.
One node is killed outright mid-run (a reclaim without notice); the other two re-rendezvous,
resume from the last checkpoint and go on; the node started again joins; the run finishes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training_helpers import BIN, ROOT, MotoServer, Run, free_port, kill_tree, storage_env, wait_port

STEPS = 240


def wait_any(nodes: list[Run], pattern: str, timeout: float) -> str:
    """The first line matching `pattern` on any node (which node gets which rank is the
    rendezvous' choice)."""
    deadline = time.monotonic() + timeout
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        for run in nodes:
            for line in list(run.lines):
                if regex.search(line):
                    return line
        time.sleep(0.1)
    raise AssertionError(f"no node printed {pattern!r}:\n" + "\n---\n".join(r.output[-1500:] for r in nodes))


def _node(index: int, port: int, moto: MotoServer, tmp: Path) -> Run:
    env = {**os.environ, **storage_env(moto.url), "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "3", "MIN_NNODES": "2",
           "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_LAST_CALL_S": "3",
           "GTS_NODE_GROUP": "local", "RDZV_KEY": "local-test-key-" + "0" * 32, "CHECKPOINT_URL": f"s3://{moto.bucket}/elastic/", "TRAIN_STEPS": str(STEPS),
           "CHECKPOINT_DIR": str(tmp / f"node{index}")}
    proc = subprocess.Popen(["bash", str(ROOT / "training/entrypoint.sh"), "--workload", "tiny",
                             "--checkpoint-every", "20", "--log-every", "10", "--throttle-ms", "60"],
                            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = Run(proc)
    run.start_reader()
    return run


def test_three_nodes_lose_one_go_on_and_take_it_back(tmp_path: Path) -> None:
    moto = MotoServer()
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "training.rdzv_store", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nodes: list[Run] = []
    try:
        wait_port(port)
        nodes = [_node(i, port, moto, tmp_path) for i in range(3)]
        wait_any(nodes, r"rank 0 of 3 ", timeout=120)
        wait_any(nodes, r"checkpoint step 40:", timeout=120)
        kill_tree(nodes[2].proc.pid)  # node 2 is gone: no notice, no checkpoint
        nodes[2].proc.wait(timeout=30)
        # The two others: their collectives fail, their agents re-rendezvous with each other.
        wait_any(nodes[:2], r"rank \d of 2 ", timeout=180)
        resumed = wait_any(nodes[:2], r"resumed from step \d+", timeout=120)
        assert int(resumed.split("resumed from step ")[1].split()[0]) >= 40, resumed
        wait_any(nodes[:2], r"world size 3 -> 2 since step", timeout=30)
        nodes[2] = _node(2, port, moto, tmp_path)  # a replacement node
        wait_any([nodes[2]], r"rank \d of 3 ", timeout=180)
        for run in nodes:
            assert run.finish(timeout=300) == 0, run.output[-3000:]
        finals = [line for run in nodes for line in run.lines if line.startswith("final step=")]
        assert len(finals) == 1 and finals[0].startswith(f"final step={STEPS} "), finals
        keys = moto.keys("elastic/")
        assert f"elastic/step-{STEPS:08d}/manifest-node000.json" in keys
    finally:
        for run in nodes:
            if run.proc.poll() is None:
                kill_tree(run.proc.pid)
        store.terminate()
        store.wait(timeout=10)
        moto.stop()


@pytest.mark.parametrize("nnodes,endpoint,launcher,named", [
    ("2", "", "torchrun", "NNODES=2 needs RDZV_ENDPOINT"),
])
def test_a_multi_node_run_without_a_store_never_trains_alone(nnodes: str, endpoint: str, launcher: str, named: str,
                                                             tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "NNODES": nnodes,
           "RDZV_ENDPOINT": endpoint, "LAUNCHER": launcher, "NPROC_PER_NODE": "1"}
    proc = subprocess.run(["bash", str(ROOT / "training/entrypoint.sh")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and named in proc.stderr and "torchrun" not in proc.stderr
