"""Multi-node training that survives losing a node: three local "nodes" (each the image's
entrypoint with its own torchrun and its own scratch), one rendezvous store apart from them
(training/node/rdzv_store.py, as the stack runs it), checkpoints in one S3 bucket on 127.0.0.1.
One node is killed outright mid-run (a reclaim without notice); the other two re-rendezvous,
resume from the last checkpoint and go on; a replacement node with an empty disk joins and
resumes from the bucket (never step 0: issue 46); the run finishes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.training_helpers import BIN, ROOT, MotoServer, Run, elastic_cluster, elastic_node, kill_tree, wait_any

STEPS = 240


def _node(index: int, port: int, moto: MotoServer, tmp: Path) -> Run:
    """Node `index` with its own checkpoint folder (tmp/node<index>): the nodes' folders differ."""
    return elastic_node(tmp, index, port, moto, ["--workload", "tiny", "--checkpoint-every", "20", "--log-every", "10",
                                                 "--throttle-ms", "60"],
                        NNODES="3", MIN_NNODES="2", NPROC_PER_NODE="1", RDZV_LAST_CALL_S="3",
                        CHECKPOINT_URL=f"s3://{moto.bucket}/elastic/", TRAIN_STEPS=str(STEPS))


def test_three_nodes_lose_one_go_on_and_take_it_back(tmp_path: Path) -> None:
    with elastic_cluster() as (moto, port, nodes):
        nodes.extend(_node(i, port, moto, tmp_path) for i in range(3))  # one by one: a node started is a node stopped
        wait_any(nodes, r"rank 0 of 3 ", timeout=120)
        wait_any(nodes, r"checkpoint step 40:", timeout=120)
        kill_tree(nodes[2].proc.pid)  # node 2 is gone: no notice, no checkpoint
        nodes[2].proc.wait(timeout=30)
        # The two others: their collectives fail, their agents re-rendezvous with each other.
        wait_any(nodes[:2], r"rank \d of 2 ", timeout=180)
        _, resumed = wait_any(nodes[:2], r"resumed from step \d+", timeout=120)
        assert int(resumed.split("resumed from step ")[1].split()[0]) >= 40, resumed
        wait_any(nodes[:2], r"world size 3 -> 2 since step", timeout=30)
        survivors_at = int(resumed.split("resumed from step ")[1].split()[0])
        # A replacement node with an empty disk (a folder no node used): it restores from the
        # bucket, files checked against the manifest of the node that wrote them (issue 46).
        nodes[2] = _node(3, port, moto, tmp_path)
        wait_any([nodes[2]], r"rank \d of 3 ", timeout=180)
        _, joined = wait_any([nodes[2]], r"resumed from step \d+", timeout=120)
        assert int(joined.split("resumed from step ")[1].split()[0]) >= survivors_at, joined
        for run in nodes:
            assert run.finish(timeout=300) == 0, run.output[-3000:]
        finals = [line for run in nodes for line in run.lines if line.startswith("final step=")]
        assert len(finals) == 1 and finals[0].startswith(f"final step={STEPS} "), finals
        # Never a step refused for another node's digest, never a restart from step 0 over the
        # bucket's history: every resume is at or past the one before it.
        assert not [line for run in nodes for line in run.lines if "skipping checkpoint step" in line]
        resumes = [int(line.split("resumed from step ")[1].split()[0]) for run in nodes for line in run.lines
                   if "resumed from step " in line]
        assert resumes and min(resumes) >= 40, resumes
        keys = moto.keys("elastic/")
        assert f"elastic/step-{STEPS:08d}/manifest-node000.json" in keys


@pytest.mark.parametrize("nnodes,endpoint,launcher,named", [
    ("2", "", "torchrun", "NNODES=2 needs RDZV_ENDPOINT"),
])
def test_a_multi_node_run_without_a_store_never_trains_alone(nnodes: str, endpoint: str, launcher: str, named: str,
                                                             tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "NNODES": nnodes,
           "RDZV_ENDPOINT": endpoint, "LAUNCHER": launcher, "NPROC_PER_NODE": "1"}
    proc = subprocess.run(["bash", str(ROOT / "training/node/entrypoint.sh")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and named in proc.stderr and "torchrun" not in proc.stderr
