"""Issue 46: a lost node costs the steps since the newest peer copy, not those since the newest
durable checkpoint. Three local "nodes" (each the image's entrypoint with its own torchrun, its
own scratch and its own peer store), one rendezvous store, checkpoints in one S3 bucket on
127.0.0.1 every 50 steps and peer copies every 5. One node is killed outright after a peer copy
newer than the bucket's newest step; the survivors restore that newer step from the peer stores;
a replacement node with an empty disk joins; the run finishes."""

from __future__ import annotations

import re
from pathlib import Path

from tests.training_helpers import MotoServer, Run, elastic_cluster, elastic_node, free_port, kill_tree, wait_any

STEPS = 200


def _node(index: int, port: int, moto: MotoServer, tmp: Path) -> Run:
    return elastic_node(tmp, index, port, moto, ["--workload", "tiny", "--checkpoint-every", "50", "--log-every", "10",
                                                 "--throttle-ms", "60"],
                        NNODES="3", MIN_NNODES="2", NPROC_PER_NODE="1", RDZV_LAST_CALL_S="3", PEER_EVERY="5",
                        PEER_PORT=str(free_port()), CHECKPOINT_URL=f"s3://{moto.bucket}/peer/", TRAIN_STEPS=str(STEPS))


def _step(line: str, pattern: str) -> int:
    found = re.search(pattern, line)
    assert found, line
    return int(found.group(1))


def test_the_survivors_restore_the_newest_peer_copy_not_the_bucket_s_step(tmp_path: Path) -> None:
    with elastic_cluster() as (moto, port, nodes):
        nodes.extend(_node(i, port, moto, tmp_path) for i in range(3))  # one by one: a node started is a node stopped
        wait_any(nodes, r"rank 0 of 3 ", timeout=120)
        wait_any(nodes, r"checkpoint step 50:", timeout=120)
        _, copied = wait_any(nodes, r"peer copy of step (6[5-9]|7\d) on node", timeout=120)
        kill_tree(nodes[2].proc.pid)  # node 2 and its peer store are gone: no notice, no checkpoint
        nodes[2].proc.wait(timeout=30)
        held = _step(copied, r"peer copy of step (\d+)")
        after = {i: len(run.lines) for i, run in enumerate(nodes)}
        # its peer store refuses connections: dropped at once, not after 2 s x 5 of missed heartbeats
        wait_any(nodes[:2], r"rdzv_launch: node \S+ is gone \(its heartbeat is", timeout=120, after=after)
        wait_any(nodes[:2], r"rank \d of 2 ", timeout=180, after=after)
        _, restored = wait_any(nodes[:2], r"restores step (\d+) from peer memory", timeout=120, after=after)
        _, resumed = wait_any(nodes[:2], r"resumed from step (\d+)", timeout=120, after=after)
        assert _step(resumed, r"resumed from step (\d+)") == _step(restored, r"restores step (\d+)") >= held > 50
        nodes[2] = _node(3, port, moto, tmp_path)  # a replacement node, its disk empty
        wait_any([nodes[2]], r"rank \d of 3 ", timeout=180)
        for run in nodes:
            assert run.finish(timeout=300) == 0, run.output[-3000:]
        finals = [line for run in nodes for line in run.lines if line.startswith("final step=")]
        assert len(finals) == 1 and finals[0].startswith(f"final step={STEPS} "), finals
        assert not [line for run in nodes for line in run.lines if "skipping checkpoint step" in line]
