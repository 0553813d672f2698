"""PyTorch Lightning through the spot-safe manager, under its DDP strategy with two CPU
processes started by the image's entrypoint: checkpoints verified and uploaded, SIGTERM (the spot
notice) answered with an emergency checkpoint at the same step on both ranks, the node's disk
lost, the run resumed from the bucket and finished; a start after the end trains nothing."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

from tests.test_user_code import final_line, start
from tests.training_helpers import ROOT
from training import contract

EXAMPLE = ROOT / "examples" / "lightning_loop.py"
ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]


def node(tmp_path: Path, scratch: str, pause_at: int = 0) -> dict[str, str]:
    command = [str(EXAMPLE), "--max-steps", "30", "--pause-at", str(pause_at)]
    return {contract.TRAIN_COMMAND.name: contract.encode_command(command), contract.NPROC_PER_NODE.name: "2",
            contract.CHECKPOINT_DIR.name: str(tmp_path / scratch), contract.CHECKPOINT_EVERY.name: "8",
            contract.CHECKPOINT_URL.name: f"file://{tmp_path / 'bucket'}"}


def test_lightning_ddp_stops_with_a_checkpoint_and_resumes_from_the_bucket(tmp_path: Path) -> None:
    first = start(ENTRYPOINT, node(tmp_path, "node-a", pause_at=10), tmp_path)  # step 10 waits for the signal
    first.wait_for(r"checkpoint step 8 committed", timeout=150)
    first.wait_for(r"step 10 loss")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", first.output).group(1))  # type: ignore[union-attr]
    assert stopped == 10
    assert "final step=" not in first.output
    committed = tmp_path / "bucket" / f"step-{stopped:08d}"
    assert sorted(p.name for p in committed.iterdir()) == ["lightning.ckpt", "manifest-node000.json"]
    shutil.rmtree(tmp_path / "node-a")  # the reclaimed node's disk is gone

    second = start(ENTRYPOINT, node(tmp_path, "node-b"), tmp_path)
    assert second.finish() == 0, second.output[-3000:]
    second.wait_for(rf"fetched step-{stopped:08d} from file://")
    second.wait_for(rf"resuming Lightning from checkpoint step {stopped}\b")
    assert final_line(second) == "final step=30"
    assert (tmp_path / "bucket" / "step-00000030" / "manifest-node000.json").is_file()

    again = start(ENTRYPOINT, node(tmp_path, "node-b"), tmp_path)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(r"run complete: checkpoint step 30 is at max_steps; nothing to train")


def test_lightning_with_a_stateful_dataloader_is_refused_with_one_line(tmp_path: Path) -> None:
    """Lightning resumes a StatefulDataLoader on other samples than an uninterrupted run's (issue
    42): the callback refuses the combination before training, naming it and the way out."""
    env = node(tmp_path, "node-a")
    env[contract.TRAIN_COMMAND.name] = contract.encode_command([str(EXAMPLE), "--max-steps", "30", "--stateful"])
    run = start(ENTRYPOINT, env, tmp_path)
    assert run.finish() == 2, run.output[-3000:]
    line = [x for x in run.output.splitlines() if x.strip()][-1]
    assert line.startswith("entrypoint: refused: Lightning with StatefulDataLoader does not resume exactly here: "), line
    assert "Pass a plain DataLoader" in line and "Traceback" not in run.output, run.output[-3000:]
    assert "step 1 loss" not in run.output and not list((tmp_path / "node-a").glob("**/step-*"))
