"""Sharded (FSDP2) training with real processes on CPU (gloo): the gpt-tiny workload's shards
checkpointed by every rank (training/ckpt/sharded.py), verified on every rank before use, resumed
bit-exactly at the same world size and resharded into another one after a node is lost."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.training_helpers import (BIN, ROOT, MotoServer, Run, elastic_node, kill_tree, launch, rendezvous_store,
                                    wait_any)
from training import contract
from training.trainer.models import TinyGPT
from training.ckpt.sharded import read_full_model, state_sha256

GPT = ["--workload", "gpt-tiny", "--sharding", "fsdp", "--batch-size", "8", "--tiny-samples", "512", "--log-every", "2"]
RESTORED = re.compile(r"restored step (\d+) saved by (\d+) ranks into (\d+): params_sha256=([0-9a-f]{64})")


def checkpoint_hash(folder: Path) -> str:
    """The full parameters of a step's folder, read in this process (no process group) and hashed
    as the trainer hashes its gathered parameters: an independent reading of the shards."""
    return state_sha256(read_full_model(folder, TinyGPT(64, 32, 2, 4, 16).state_dict()))


def test_stopped_and_resumed_equals_uninterrupted_and_a_bad_shard_means_the_previous_step(tmp_path: Path) -> None:
    args = [*GPT, "--steps", "24", "--checkpoint-every", "4"]
    straight = launch([*args, "--checkpoint-dir", str(tmp_path / "a")], tmp_path)
    assert straight.finish() == 0, straight.output[-3000:]
    _, _, expected = straight.final()

    folder = tmp_path / "b"
    stopped = launch([*args, "--checkpoint-dir", str(folder), "--throttle-ms", "150"], tmp_path)
    stopped.wait_for(r"checkpoint step 4:", timeout=120)
    os.kill(stopped.proc.pid, signal.SIGTERM)  # torchrun passes it to the workers: save, then stop
    stopped.finish()  # torchrun exits 1 even when the workers stopped cleanly (TRAINING_FACTS.md)
    at = int(stopped.wait_for(r"stopped by SIGTERM at step (\d+)").split("at step ")[1].split()[0])
    steps = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-????????"))
    assert steps[-1] == at and len(steps) >= 2, steps

    # One byte of rank 1's shard of the newest step: every rank must refuse that step.
    shard = folder / f"step-{at:08d}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    previous = tmp_path / "previous"  # the fallback step, as committed (keep-K prunes it later in the run)
    shutil.copytree(folder / f"step-{steps[-2]:08d}", previous)

    resumed = launch([*args, "--checkpoint-dir", str(folder)], tmp_path)
    assert resumed.finish() == 0, resumed.output[-3000:]
    skipped = resumed.wait_for(rf"skipping checkpoint step {at}: rank \d")
    assert "__1_0.distcp does not match its digest" in skipped and "1 more rank" in skipped, skipped
    match = RESTORED.search(resumed.output)
    assert match, resumed.output[-3000:]
    assert int(match.group(1)) == steps[-2] and match.group(2) == match.group(3) == "2", match.group(0)
    # What was restored is what that step holds, read back independently of the trainer.
    assert match.group(4) == checkpoint_hash(previous)
    step, _, digest = resumed.final()
    assert step == 24 and digest == expected, (digest, expected)


def _node(index: int, port: int, moto: MotoServer, tmp: Path, steps: int) -> Run:
    return elastic_node(tmp, index, port, moto, [*GPT, "--checkpoint-every", "4", "--keep", "20", "--throttle-ms", "100"],
                        NNODES="2", MIN_NNODES="1", NPROC_PER_NODE="2", RDZV_LAST_CALL_S="10",
                        CHECKPOINT_URL=f"s3://{moto.bucket}/sharded/", TRAIN_STEPS=str(steps))


def test_four_ranks_lose_a_node_and_two_go_on_resharded(tmp_path: Path) -> None:
    steps = 40
    moto = MotoServer()
    nodes: list[Run] = []
    with rendezvous_store() as port:
        try:
            nodes = [_node(i, port, moto, tmp_path, steps) for i in range(2)]
            first, _ = wait_any(nodes, r"rank 0 of 4 ", timeout=180)
            mark = {i: len(run.lines) for i, run in enumerate(nodes)}
            for i in range(2):  # step 8 is in the bucket from both nodes: a resumable point without either
                wait_any([nodes[i]], r"uploaded step-00000008 ", timeout=180, after={0: mark[i]})
            before = {int(m.group(1)): float(m.group(2)) for run in nodes for m in
                      (re.search(r"step (\d+) loss ([\d.]+)$", x) for x in list(run.lines)) if m}
            lost = 1 - first  # the node without rank 0, so the log lines stay on the survivor
            kill_tree(nodes[lost].proc.pid)  # a reclaim without notice: no emergency checkpoint
            nodes[lost].proc.wait(timeout=30)
            survivor = nodes[first]
            seen = len(survivor.lines)
            _, line = wait_any([survivor], r"rank 0 of 2 ", timeout=180, after={0: seen})
            _, line = wait_any([survivor], RESTORED.pattern, timeout=120, after={0: seen})
            restored = RESTORED.search(line)
            assert restored and restored.group(2) == "4" and restored.group(3) == "2", line
            step = int(restored.group(1))
            assert step >= 8, line
            assert survivor.finish(timeout=300) == 0, survivor.output[-3000:]
            final = [x for x in survivor.lines if x.startswith("final step=")]
            assert len(final) == 1 and final[0].startswith(f"final step={steps} "), final

            # The 2 ranks hold exactly the parameters the 4 ranks saved (read back from the bucket; --keep 20
            # keeps the step there).
            folder = tmp_path / "from-bucket"
            folder.mkdir()
            client = moto.client()
            for key in moto.keys(f"sharded/step-{step:08d}/"):
                client.download_file(moto.bucket, key, str(folder / key.rsplit("/", 1)[1]))
            assert restored.group(4) == checkpoint_hash(folder)
            # The loss goes on from where the 4 ranks left it, not from an untrained model's ln(vocab).
            after = [float(m.group(1)) for x in survivor.lines[seen:] if (m := re.search(rf"step {step + 2} loss ([\d.]+)$", x))]
            assert after and step in before, (after, sorted(before))
            assert abs(after[0] - before[step]) < 0.25 * before[step] and after[0] < 0.95 * math.log(64), (after, before)
            assert f"sharded/step-{steps:08d}/manifest-node000.json" in moto.keys("sharded/")
        finally:
            for run in nodes:
                if run.proc.poll() is None:
                    kill_tree(run.proc.pid)
            moto.stop()


# ------------------------------------------------------------------ a user's own FSDP2 loop, the library only

FSDP_LOOP = ROOT / "examples" / "fsdp_loop.py"
LOOP_STEPS = 24
LOOP_FINAL = re.compile(r"^final step=(\d+) params_sha256=([0-9a-f]{64})$", re.M)
LOOP_RESUMED = re.compile(r"^resumed at step (\d+) params_sha256=([0-9a-f]{64})$", re.M)


def loop_hash(folder: Path) -> str:
    """The full parameters of one of the loop's steps, read in this process from its files."""
    spec = importlib.util.spec_from_file_location("fsdp_loop", FSDP_LOOP)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return state_sha256(read_full_model(folder, module.build(7).state_dict()))


def start_loop(tmp: Path, nproc: int, url: str, scratch: str, *extra: str, env: dict[str, str] | None = None) -> Run:
    """examples/fsdp_loop.py as the stack runs a user's command: the node's entrypoint, torchrun,
    `nproc` CPU processes (gloo), the contract's variables."""
    command = contract.encode_command([str(FSDP_LOOP), "--steps", str(LOOP_STEPS), *extra])
    base = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "1", "MIN_NNODES": "1",
            "NPROC_PER_NODE": str(nproc), contract.TRAIN_COMMAND.name: command, contract.CHECKPOINT_URL.name: url,
            contract.CHECKPOINT_DIR.name: str(tmp / scratch), contract.CHECKPOINT_EVERY.name: "4"}
    proc = subprocess.Popen(["bash", str(ROOT / "training" / "node" / "entrypoint.sh")], cwd=tmp, env={**base, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = Run(proc)
    run.start_reader()
    return run


@dataclass
class Stopped:
    reference: str  # the uninterrupted run's final gathered hash
    bucket: Path  # the bucket as the stopped run left it (a copy per test)
    step: int  # where SIGTERM stopped it
    saved: str  # that step's full parameters, read from the bucket's files


@pytest.fixture(scope="module")
def stopped_loop(tmp_path_factory: pytest.TempPathFactory) -> Stopped:
    """Two ranks run the loop uninterrupted; two more run it against a file:// bucket with
    CHECKPOINT_EVERY=auto, are stopped by SIGTERM after a checkpoint is in the bucket, and
    their node's disk is deleted."""
    tmp = tmp_path_factory.mktemp("fsdp-loop")
    reference = start_loop(tmp, 2, "", "ref")
    assert reference.finish() == 0, reference.output[-3000:]
    match = LOOP_FINAL.search(reference.output)
    assert match and int(match.group(1)) == LOOP_STEPS, reference.output[-3000:]

    bucket = tmp / "bucket"
    # Step 20 waits for the signal: the run cannot end before SIGTERM reaches it, whatever the load.
    first = start_loop(tmp, 2, f"file://{bucket}", "node-a", "--sleep-ms", "150", "--pause-at", "20",
                       env={contract.CHECKPOINT_EVERY.name: "auto", contract.MTBF_S.name: "2",
                            contract.NOTICE_S.name: "0"})
    first.wait_for(r"uploaded step-\d{8} ", timeout=120)
    os.kill(first.proc.pid, signal.SIGTERM)  # the spot notice, to the node's entrypoint
    assert first.finish() == 0, first.output[-3000:]
    at = int(first.wait_for(r"stopped by SIGTERM at step \d+").rsplit("step ", 1)[1].split()[0])
    assert at < LOOP_STEPS and not LOOP_FINAL.search(first.output)
    assert "Daly (FGCS 2006)" in first.wait_for(r"checkpoint interval: every \d+ steps")  # auto took them
    shutil.rmtree(tmp / "node-a")  # the node is gone, its disk with it
    step = bucket / f"step-{at:08d}"
    assert sorted(p.name for p in step.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (step / "manifest-node000.json").is_file(), "the emergency checkpoint is in the bucket"
    return Stopped(match.group(2), bucket, at, loop_hash(step))


def test_a_users_fsdp_loop_resumes_from_the_bucket_after_sigterm_and_a_lost_disk(stopped_loop: Stopped,
                                                                                 tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    shutil.copytree(stopped_loop.bucket, bucket)
    second = start_loop(tmp_path, 2, f"file://{bucket}", "node-b")
    assert second.finish() == 0, second.output[-3000:]
    resumed = LOOP_RESUMED.search(second.output)
    assert resumed, second.output[-3000:]
    assert int(resumed.group(1)) == stopped_loop.step and resumed.group(2) == stopped_loop.saved
    second.wait_for(rf"restored sharded step {stopped_loop.step} saved by 2 ranks into 2$")
    second.wait_for(rf"rank [01] fetched step-{stopped_loop.step:08d} from file://")  # nothing was left on disk
    final = LOOP_FINAL.search(second.output)
    assert final and final.group(2) == stopped_loop.reference, "not the uninterrupted run's parameters"


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_users_fsdp_checkpoint_of_two_ranks_resumes_on_fewer_or_more(stopped_loop: Stopped, tmp_path: Path,
                                                                        nproc: int) -> None:
    """2 -> 1 (a lost node) and 2 -> 3 (a joined one): DCP reshards; the gathered parameters are
    the saved ones, and the run goes on to its end, checkpointed by its own ranks."""
    bucket = tmp_path / "bucket"
    shutil.copytree(stopped_loop.bucket, bucket)
    run = start_loop(tmp_path, nproc, f"file://{bucket}", "node-c")
    assert run.finish() == 0, run.output[-3000:]
    run.wait_for(rf"restored sharded step {stopped_loop.step} saved by 2 ranks into {nproc}$")
    resumed = LOOP_RESUMED.search(run.output)
    assert resumed and int(resumed.group(1)) == stopped_loop.step, run.output[-3000:]
    assert resumed.group(2) == stopped_loop.saved
    final = LOOP_FINAL.search(run.output)
    assert final and int(final.group(1)) == LOOP_STEPS, run.output[-3000:]
    last = bucket / f"step-{LOOP_STEPS:08d}"
    assert sorted(p.name for p in last.glob("__*.distcp")) == [f"__{r}_0.distcp" for r in range(nproc)]
    assert loop_hash(last) == final.group(2)


def test_the_checkpointer_feeds_a_sharded_upload_back_to_auto_and_names_a_second_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, `sharded=True` (a one-process run of an FSDP loop holds a plain model): the
    DCP step goes to a file:// bucket, and the time until it is there reaches checkpointEvery
    auto's plan, as for replicated state. Two models: refused, named."""
    from torch import nn

    from training.ckpt.checkpointer import Checkpointer

    for var, value in ((contract.CHECKPOINT_EVERY, "auto"), (contract.MTBF_S, "2"), (contract.NOTICE_S, "0")):
        monkeypatch.setenv(var.name, value)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    bucket = tmp_path / "bucket"
    try:
        model = nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        with Checkpointer(url=f"file://{bucket}", local_dir=str(tmp_path / "ck"), sharded=True, model=model,
                          optimizer=optimizer) as ckpt:
            assert ckpt.sharded is not None and ckpt.interval.auto is not None
            ckpt.step(1)  # measures nothing yet; the save below is the one the plan hears about
            ckpt.save(2)
            assert ckpt.manager.wait_uploads(60)
            assert ckpt.interval.auto.durable is not None and ckpt.interval.auto.durable > 0
        assert ckpt.exit_code == 0
        assert sorted(p.name for p in (bucket / "step-00000002").iterdir()) == [
            "__0_0.distcp", "dcp.metadata", "manifest-node000.json", "rng-rank00000.pt", "train-state.pt"]
        with pytest.raises(ValueError, match=r"pass exactly one model .* got 2 \(a, b\)"):
            Checkpointer(local_dir=str(tmp_path / "two"), sharded=True, a=nn.Linear(2, 2), b=nn.Linear(2, 2))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
