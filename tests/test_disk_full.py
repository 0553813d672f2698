"""A full disk under the checkpoint library, on a real (tiny) tmpfs: the error names the disk
and what the step needed, no partial step stays, an explicit save() raises, and a user's loop
through the image's entrypoint stops with that line instead of reporting success. Mounting
needs root; elsewhere these tests are skipped (tests/test_trainer_honesty.py injects ENOSPC)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.test_user_code import start
from tests.training_helpers import ROOT
from training import contract
from training.ckpt.manager import CheckpointError, CheckpointManager, Topology
from training.ckpt.checkpointer import Checkpointer

TOPO = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)
ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Take every free block of `disk`."""
    fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


FULL = r"the disk holding {folder} \(the file system mounted at {disk}\) is full: the step needed about {mib} MiB"


def test_a_step_bigger_than_the_disk_names_the_disk_and_its_size_and_leaves_nothing(disk: Path) -> None:
    manager = CheckpointManager(str(disk / "ck"), None, TOPO)
    manager.save(5, {"w": torch.zeros(1 << 20)}, {"x": torch.ones(1)}, lambda: None)  # 4 MiB of model state
    manager.wait_commit()
    assert re.fullmatch(r"step-00000005: " + FULL.format(folder=re.escape(str(disk / "ck")), disk=re.escape(str(disk)),
                                                          mib="4.0") + r", .*", manager.write_error), manager.write_error
    assert not list((disk / "ck").glob("step-*")), "no half step"


def test_an_explicit_save_raises_when_its_step_could_not_be_written(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", contract.CHECKPOINT_URL.name):
        monkeypatch.delenv(name, raising=False)
    model = nn.Linear(1024, 1024)  # 4 MiB of parameters
    with Checkpointer(10, local_dir=str(disk / "ck"), model=model) as ckpt:
        with pytest.raises(CheckpointError, match=r"checkpoint step 3 could not be written: step-00000003: the disk "
                                                  r"holding .* is full: the step needed about 4\.0 MiB"):
            ckpt.save(3)
    assert ckpt.exit_code == 1


def test_a_loop_on_a_full_disk_stops_with_the_disk_named_not_a_success(disk: Path, tmp_path: Path) -> None:
    command = [str(ROOT / "examples" / "plain_loop.py"), "--steps", "100000", "--sleep-ms", "20"]
    env = {contract.TRAIN_COMMAND.name: contract.encode_command(command), contract.NPROC_PER_NODE.name: "2",
           contract.CHECKPOINT_DIR.name: str(disk / "ck"), contract.CHECKPOINT_EVERY.name: "10"}
    run = start(ENTRYPOINT, env, tmp_path)
    run.wait_for(r"committed checkpoint step-00000010 locally")
    fill(disk)  # the disk fills up while the run trains
    assert run.finish() != 0, run.output[-3000:]
    run.wait_for(r"CheckpointError: checkpoint step-00000020 could not be written: the disk holding "
                 rf"{re.escape(str(disk / 'ck'))} \(the file system mounted at {re.escape(str(disk))}\) is full")
    assert "final step=" not in run.output
    assert sorted(p.name for p in (disk / "ck").iterdir() if p.name.startswith("step-")) == ["step-00000010"]
    os.unlink(disk / "ballast")
