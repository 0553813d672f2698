"""A warm spare (nodeGroups[].scaling.spares) with real processes: three local "nodes" and a
fourth that arrives when their world is full, each the image's entrypoint with its own torchrun
and its own scratch, one rendezvous store apart from them, checkpoints in one S3 bucket on
127.0.0.1. The fourth waits outside the run without disturbing it (torch puts it on the round's
redundancy list, training/node/rdzv_launch.py says where); one member is killed outright; the
next world is three nodes again, with the spare in it, resumed from the newest checkpoint."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from tests.training_helpers import MotoServer, Run, descendants, elastic_cluster, elastic_node, kill_tree, wait_any

STEPS = 240
WORLD = re.compile(r"rank \d of (\d) ")


def _node(index: int, port: int, moto: MotoServer, tmp: Path, nnodes: int = 3, steps: int = STEPS) -> Run:
    """One node, in a folder of its own with its checkpoints at the same relative path on every
    node, as real nodes have them (one path on each node's own disk): the spare's disk is empty."""
    (tmp / f"host{index}").mkdir()
    return elastic_node(tmp / f"host{index}", index, port, moto, ["--workload", "tiny", "--checkpoint-every", "20", "--log-every", "10",
                                                 "--throttle-ms", "60"],
                        NNODES=str(nnodes), MIN_NNODES="2", NPROC_PER_NODE="1", RDZV_LAST_CALL_S="3", CHECKPOINT_DIR="ckpt",
                        CHECKPOINT_URL=f"s3://{moto.bucket}/spares/", TRAIN_STEPS=str(steps),
                        HANG_TIMEOUT_S="600")  # the members' workers may be held stopped while a spare boots


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _worlds(run: Run, start: int = 0) -> list[str]:
    """The world sizes this node's workers were started in, in order (their `rank r of n` lines)."""
    return [m.group(1) for line in run.lines[start:] if (m := WORLD.search(line))]


def _newest_in_bucket(moto: MotoServer) -> int:
    manifests = [re.fullmatch(r"spares/step-(\d+)/manifest-node(\d+)\.json", key) for key in moto.keys("spares/")]
    nodes: dict[int, set[str]] = {}
    for m in filter(None, manifests):
        nodes.setdefault(int(m.group(1)), set()).add(m.group(2))
    return max(step for step, written in nodes.items() if len(written) == 3)


def test_a_spare_waits_outside_the_world_and_takes_a_lost_members_place(tmp_path: Path) -> None:
    with elastic_cluster() as (moto, port, nodes):
        nodes.extend(_node(i, port, moto, tmp_path) for i in range(3))  # one by one: a node started is a node stopped
        for run in nodes:  # every member's worker has started and said so (else its line comes after `seen`)
            wait_any([run], r"rank \d of 3 ", timeout=120)
        # through the image's entrypoint, each node's worker is forked by its warm process
        # (training/node/warm.py): the seam from the entrypoint to a warm start, not a cold one
        workers = []
        for run in nodes:
            warm = [p for p in descendants(run.proc.pid) if _comm(p) == "gts-warm"]
            assert len(warm) == 1 and descendants(warm[0]), run.output[-2000:]
            workers += descendants(warm[0])
        # The members' workers wait (stopped; their agents go on) while the spare boots, however
        # long a loaded machine takes: the run must not end before the spare is there.
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        nodes.append(_node(3, port, moto, tmp_path))  # the spare: the world is full when it comes
        wait_any([nodes[3]], r"rdzv_launch: held as a spare", timeout=120)
        seen = {i: len(run.lines) for i, run in enumerate(nodes[:3])}
        last = max([int(m.group(1)) for run in nodes[:3] for line in run.lines
                    if (m := re.search(r"checkpoint step (\d+):", line))] or [0])
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        # The members go on through two more checkpoints in the same world: no new round.
        wait_any(nodes[:3], rf"checkpoint step {last + 20}:", timeout=120, after=seen)
        wait_any(nodes[:3], rf"checkpoint step {last + 40}:", timeout=120, after=seen)
        assert [_worlds(run, seen[i]) for i, run in enumerate(nodes[:3])] == [[], [], []]
        assert _worlds(nodes[3]) == [], nodes[3].output[-2000:]
        kill_tree(nodes[2].proc.pid)  # a member is gone: no notice, no checkpoint
        nodes[2].proc.wait(timeout=30)
        wait_any([nodes[3]], r"rdzv_launch: the spare leaves the redundancy list", timeout=120)
        wait_any([nodes[3]], r"rank \d of 3 ", timeout=180)
        _, resumed = wait_any(nodes, r"resumed from step \d+", timeout=120, after=seen)
        # The newest step the new world can all read: the spare's disk is empty, so the bucket's
        # newest with every node's manifest (nothing is uploaded between the kill and the resume).
        assert int(resumed.split("resumed from step ")[1].split()[0]) == _newest_in_bucket(moto), resumed
        for i in (0, 1, 3):
            assert nodes[i].finish(timeout=300) == 0, nodes[i].output[-3000:]
        # The world came back at three nodes without a shrink in between.
        for i in (0, 1):
            assert set(_worlds(nodes[i])) == {"3"}, _worlds(nodes[i])
            assert "world size 3 -> 2" not in nodes[i].output
        finals = [line for run in nodes for line in run.lines if line.startswith("final step=")]
        assert len(finals) == 1 and finals[0].startswith(f"final step={STEPS} "), finals
        assert not [run for run in nodes if "gts.warm: this worker starts cold" in run.output]  # restarts warm too


def test_a_spare_still_waiting_when_the_run_ends_exits_cleanly(tmp_path: Path) -> None:
    with elastic_cluster() as (moto, port, nodes):
        nodes.extend(_node(i, port, moto, tmp_path, nnodes=2, steps=80) for i in range(2))
        wait_any(nodes, r"rank 0 of 2 ", timeout=120)
        nodes.append(_node(2, port, moto, tmp_path, nnodes=2, steps=80))
        wait_any([nodes[2]], r"rdzv_launch: held as a spare", timeout=120)
        for run in nodes[:2]:
            assert run.finish(timeout=300) == 0, run.output[-3000:]
        # The run closed its rendezvous: the spare is told so (torch's RendezvousGracefulExitError)
        # and its launcher ends with 0, not a failure its unit or its Job would retry.
        assert nodes[2].finish(timeout=120) == 0, nodes[2].output[-3000:]
        assert "rdzv_launch: the run ended while this node waited as a spare; nothing to do" in nodes[2].output
        assert _worlds(nodes[2]) == [] and "Traceback" not in nodes[2].output


def test_a_node_that_comes_after_the_run_ended_exits_cleanly(tmp_path: Path) -> None:
    """A spare or a recreated Job pod that was Pending until the run ended: it never joined the
    run, so torch's RendezvousClosedError is not its failure; it ends with 0 (an Indexed Job
    needs every index to succeed) and says why."""
    with elastic_cluster() as (moto, port, nodes):
        nodes.extend(_node(i, port, moto, tmp_path, nnodes=2, steps=40) for i in range(2))
        for run in nodes:
            assert run.finish(timeout=300) == 0, run.output[-3000:]
        nodes.append(_node(2, port, moto, tmp_path, nnodes=2, steps=40))
        assert nodes[2].finish(timeout=120) == 0, nodes[2].output[-3000:]
        assert "rdzv_launch: the run's rendezvous was already closed when this node came" in nodes[2].output
        assert _worlds(nodes[2]) == [] and "Traceback" not in nodes[2].output
