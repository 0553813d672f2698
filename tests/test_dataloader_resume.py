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

from tests.test_user_code import final_line, start
from tests.training_helpers import ROOT
from training import contract

EXAMPLE = ROOT / "examples" / "dataloader_loop.py"
ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]
BATCHES_PER_EPOCH = 96 // 2 // 4  # samples / ranks / batch size (the example's defaults)
STEPS_PER_EPOCH = BATCHES_PER_EPOCH // 2  # two batches per optimizer step


def node(tmp_path: Path, scratch: str, extra: list[str], remote: bool = True) -> dict[str, str]:
    command = [str(EXAMPLE), "--steps", "30", *extra]
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
    first.wait_for(r"step 8 epoch 1 batch 4$")
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
