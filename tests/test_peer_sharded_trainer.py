"""The trainer's sharded (FSDP2) path through the peer tier (issue 46): two local "nodes" of two
ranks each (the image's entrypoint, its own torchrun, scratch and peer store), durable checkpoints
every 10 steps to an S3 bucket on 127.0.0.1, peer copies every 2. The node without rank 0 is killed
outright after a peer copy newer than the bucket's newest step; the survivor's two ranks restore
that newer step from its own store (its own shards, and the lost node's, which it held as its
buddy), resharded from 4 ranks into 2, and the run finishes."""

from __future__ import annotations

import math
import re
from pathlib import Path

from tests.test_sharded import GPT, RESTORED
from tests.training_helpers import MotoServer, Run, elastic_cluster, elastic_node, free_port, kill_tree, wait_any

STEPS = 40


def _node(index: int, port: int, moto: MotoServer, tmp: Path) -> Run:
    return elastic_node(tmp, index, port, moto, [*GPT, "--checkpoint-every", "10", "--throttle-ms", "100"],
                        NNODES="2", MIN_NNODES="1", NPROC_PER_NODE="2", RDZV_LAST_CALL_S="3", PEER_EVERY="2",
                        PEER_PORT=str(free_port()), CHECKPOINT_URL=f"s3://{moto.bucket}/sharded-peer/",
                        TRAIN_STEPS=str(STEPS))


def test_a_sharded_run_restores_a_lost_node_s_shards_from_peer_memory_resharded(tmp_path: Path) -> None:
    with elastic_cluster() as (moto, port, nodes):
        nodes.extend(_node(i, port, moto, tmp_path) for i in range(2))
        first, _ = wait_any(nodes, r"rank 0 of 4 ", timeout=180)
        wait_any([nodes[first]], r"checkpoint step 10:", timeout=180)
        _, copied = wait_any([nodes[first]], r"peer copy of step (1[4-9]|2\d) on node", timeout=180)
        held = int(re.search(r"peer copy of step (\d+)", copied).group(1))  # type: ignore[union-attr]
        before = {int(m.group(1)): float(m.group(2)) for x in list(nodes[first].lines)
                  if (m := re.search(r"step (\d+) loss ([\d.]+)$", x))}
        lost = 1 - first  # the node without rank 0: the survivor's log says what it restored
        kill_tree(nodes[lost].proc.pid)  # no notice, no checkpoint: its shards are on the survivor's store
        nodes[lost].proc.wait(timeout=30)
        survivor, seen = nodes[first], len(nodes[first].lines)
        wait_any([survivor], r"rank 0 of 2 ", timeout=180, after={0: seen})
        _, peer = wait_any([survivor], r"restoring sharded step (\d+) from peer memory \(saved by 4 ranks\)",
                           timeout=120, after={0: seen})
        _, line = wait_any([survivor], RESTORED.pattern, timeout=120, after={0: seen})
        restored = RESTORED.search(line)
        assert restored and restored.group(2) == "4" and restored.group(3) == "2", line
        step = int(restored.group(1))
        assert f"restoring sharded step {step} " in peer and held - 2 <= step and step > 10, (peer, held)
        assert survivor.finish(timeout=300) == 0, survivor.output[-3000:]
        final = [x for x in survivor.lines if x.startswith("final step=")]
        assert len(final) == 1 and final[0].startswith(f"final step={STEPS} "), final
        # the loss goes on from where the 4 ranks left it at that step, not from an untrained model's
        after = [float(m.group(1)) for x in survivor.lines[seen:] if (m := re.search(rf"step {step + 2} loss ([\d.]+)$", x))]
        assert after and step in before, (after, sorted(before))
        assert abs(after[0] - before[step]) < 0.25 * before[step] and after[0] < 0.95 * math.log(64), (after, before)
        assert _median(survivor.lines, r"peer copy of step \d+: loop blocked ([\d.]+) s") >= 0  # the cost is logged
        _median(survivor.lines, r"checkpoint step \d+: loop blocked ([\d.]+) s")  # the durable save's, beside it


def _median(lines: list[str], pattern: str) -> float:
    """The median of a figure the log names (what a copy or a checkpoint blocked the loop); printed under -s."""
    found = sorted(float(m.group(1)) for x in lines if (m := re.search(pattern, x)))
    assert found, pattern
    print(f"{pattern}: {len(found)} lines, median {found[len(found) // 2]:.4f} s")
    return found[len(found) // 2]
