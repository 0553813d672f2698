"""An ordinary DDP loop (shuffling DistributedSampler, DataLoader, dropout, epochs, gradient
accumulation with no_sync) through the image's entrypoint with two gloo processes: SIGTERM
mid-epoch, the node's disk wiped, resumed from the bucket (file://) — the same parameters as
the uninterrupted run, with a plain DataLoader (worker processes) and torchdata's
StatefulDataLoader alike."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.test_user_code import final_line, start
from tests.training_helpers import ROOT
from training import contract
from training.loaders import fork_hang_warning

EXAMPLE = ROOT / "examples" / "dataloader_loop.py"
ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]
BATCHES_PER_EPOCH = 96 // 2 // 4  # samples / ranks / batch size (the example's defaults)
STEPS_PER_EPOCH = BATCHES_PER_EPOCH // 2  # two batches per optimizer step
# On a CPython with gh-112275 (this suite's 3.11.7), a worker forked as gloo frees a collective can
# hang before it runs (docs/trainer-and-library.md; CI met it twice): there the workers start by
# forkserver, as the library's warning tells users to. Seeds and samples are the same either way.
START = (["--start-method", "forkserver"] if fork_hang_warning(DataLoader(TensorDataset(torch.zeros(1)), num_workers=1,
                                                                           multiprocessing_context="fork")) else [])


def node(tmp_path: Path, scratch: str, extra: list[str], remote: bool = True) -> dict[str, str]:
    command = [str(EXAMPLE), "--steps", "30", *extra, *(START if "--workers" in extra else [])]
    return {contract.TRAIN_COMMAND.name: contract.encode_command(command), contract.NPROC_PER_NODE.name: "2",
            contract.CHECKPOINT_DIR.name: str(tmp_path / scratch), contract.CHECKPOINT_EVERY.name: "4",
            contract.CHECKPOINT_URL.name: f"file://{tmp_path / 'bucket'}" if remote else ""}


@pytest.mark.parametrize("loader", [["--workers", "2"], ["--stateful"]], ids=["DataLoader-workers", "Stateful"])
def test_an_ordinary_loop_resumes_exactly_mid_epoch(loader: list[str], tmp_path: Path) -> None:
    reference = start(ENTRYPOINT, node(tmp_path, "ref", loader, remote=False), tmp_path)
    assert reference.finish() == 0, reference.output[-3000:]

    # The loop waits after step 8 until it is told to stop: inside the second epoch, after a
    # committed checkpoint (step 4), whatever the machine's load.
    first = start(ENTRYPOINT, node(tmp_path, "node-a", [*loader, "--pause-at", "8"]), tmp_path)
    first.wait_for(r"step 8 epoch 1 batch 4 data ")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", first.output).group(1))  # type: ignore[union-attr]
    assert stopped == 8 and stopped % STEPS_PER_EPOCH, f"step {stopped}: the test needs a stop inside an epoch"
    assert (tmp_path / "bucket" / f"step-{stopped:08d}" / "manifest-node000.json").is_file()
    shutil.rmtree(tmp_path / "node-a")  # the reclaimed node's disk is gone

    second = start(ENTRYPOINT, node(tmp_path, "node-b", loader), tmp_path)
    assert second.finish() == 0, second.output[-3000:]
    second.wait_for(rf"resumed from checkpoint step {stopped}\b")
    assert final_line(second) == final_line(reference)


STEP_LINE = re.compile(r"step (\d+) epoch (\d+) batch (\d+) data ([0-9a-f]{16})$")


def steps_seen(output: str) -> dict[int, tuple[str, str]]:
    """step -> (epoch, digest of the samples with their noise) as rank 0 logged them (the loop's
    batch count restarts at the resume: enumerate counts what this iterator yields)."""
    return {int(m.group(1)): (m.group(2), m.group(4)) for line in output.splitlines() if (m := STEP_LINE.search(line))}


# Without a DistributedSampler every rank walks all 96 samples: 24 batches, 12 steps an epoch.
@pytest.mark.parametrize("loader", [["--workers", "2"], ["--stateful", "--workers", "2"]],
                         ids=["DataLoader-shuffle", "Stateful-shuffle"])
def test_a_loader_without_a_sampler_resumes_its_epoch_and_its_workers_noise(loader: list[str], tmp_path: Path) -> None:
    """shuffle=True, no sampler with set_epoch, noise drawn in 2 worker processes, 3 epochs
    (`for epoch in range(ckpt.epoch, 3)`): stopped inside the second epoch, the disk lost,
    resumed from the bucket: every step after the resume trains on the uninterrupted run's
    samples and noise, in its epoch, and the run ends with its parameters."""
    options = [*loader, "--no-sampler", "--augment", "0.5", "--epochs", "3", "--steps", "1000"]
    reference = start(ENTRYPOINT, node(tmp_path, "ref", options, remote=False), tmp_path)
    assert reference.finish() == 0, reference.output[-3000:]
    expected = steps_seen(reference.output)
    assert sorted(expected) == list(range(1, 37)), sorted(expected)  # 3 epochs of 12 steps

    first = start(ENTRYPOINT, node(tmp_path, "node-a", [*options, "--pause-at", "16"]), tmp_path)
    first.wait_for(r"step 16 epoch 1 batch 8 data ")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    assert (tmp_path / "bucket" / "step-00000016" / "manifest-node000.json").is_file()
    shutil.rmtree(tmp_path / "node-a")

    second = start(ENTRYPOINT, node(tmp_path, "node-b", options), tmp_path)
    assert second.finish() == 0, second.output[-3000:]
    second.wait_for(r"resumed from checkpoint step 16\b")
    resumed = steps_seen(second.output)
    digests = {s: d for s, (_, d) in resumed.items() if s in expected}
    assert digests == {s: expected[s][1] for s in digests}  # the samples, their order and their noise
    assert sorted(resumed) == list(range(17, 37)), sorted(resumed)  # not an epoch again
    assert resumed == {s: expected[s] for s in resumed}
    assert final_line(second) == final_line(reference)
