"""The checkpoint that barely blocks the loop: the state is copied into reused buffers and the
rest (serialising with the hash computed while writing, without torch's CRC, fsync, commit,
prune, upload) runs in the background, one checkpoint in flight. Still: atomic commit, integrity,
a stop that waits for its commit, and bit-exact resume after SIGTERM or SIGKILL at random points."""

from __future__ import annotations

import os
import random
import signal
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TRAIN_ARGS as ARGS
from tests.training_helpers import kill_tree, launch
from training.ckpt import manager as ck
from training.ckpt.manager import MODEL_FILE, CheckpointManager, Topology, step_dir
from training.ckpt import digest, staging
from training.ckpt.staging import Stager

TOPO = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((256, 256), value), "b": torch.zeros(3)}, "step": int(value),
            "optimizer": {"state": {0: {"exp_avg": torch.full((256, 256), value / 2)}}, "param_groups": [{"lr": 0.1}]}}


def test_save_returns_before_the_write_and_everything_after_waits_for_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    original = staging.save_hashed

    def held(obj: Any, path: Path, *copying: Any) -> tuple[int, str]:
        gate.wait(30)
        return original(obj, path, *copying)

    monkeypatch.setattr(ck, "save_hashed", held)
    mgr = CheckpointManager(str(tmp_path), None, TOPO)
    state = _state(1.0)
    mgr.save(1, state, {"x": torch.ones(1)}, lambda: None)
    assert not (tmp_path / step_dir(1)).exists(), "committed only when the background write is done"
    state["model"]["w"].fill_(99.0)  # the loop goes on changing its tensors: the checkpoint keeps step 1's
    threading.Timer(0.3, gate.set).start()
    assert mgr.local_steps() == [1]  # waits for the commit
    saved, _ = mgr.load(1)
    assert torch.equal(saved["model"]["w"], torch.full((256, 256), 1.0))
    mgr.close()


def test_the_manifest_hash_is_the_files_and_torch_crc_is_not_written(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), None, TOPO)
    mgr.save(5, _state(5.0), {"x": torch.ones(1)}, lambda: None)
    mgr.close()
    folder = tmp_path / step_dir(5)
    manifest = __import__("json").loads((folder / "manifest-node000.json").read_text())
    entry = manifest["files"][MODEL_FILE]
    assert entry == digest.entry(folder / MODEL_FILE) and manifest["format"] == digest.FORMAT
    with zipfile.ZipFile(folder / MODEL_FILE) as archive:
        assert {info.CRC for info in archive.infolist() if info.file_size} == {0}
    assert torch.load(folder / MODEL_FILE, weights_only=True)["step"] == 5
    assert torch.serialization.get_crc32_options() is True, "the switch is put back for everyone else"


def test_staging_buffers_are_reused_and_bounded() -> None:
    stager = Stager()
    first = stager.stage(_state(1.0))
    size = stager.bytes
    second = stager.stage(_state(2.0))
    assert first["model"]["w"].data_ptr() == second["model"]["w"].data_ptr()
    assert stager.bytes == size == 2 * 256 * 256 * 4 + 3 * 4
    assert torch.equal(second["model"]["w"], torch.full((256, 256), 2.0))


def test_a_failed_background_write_is_reported_and_the_previous_step_stays(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(str(tmp_path), None, TOPO)
    mgr.save(1, _state(1.0), {"x": torch.ones(1)}, lambda: None)

    def full_disk(obj: Any, path: Path, *copying: Any) -> tuple[int, str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "save_hashed", full_disk)
    mgr.save(2, _state(2.0), {"x": torch.ones(1)}, lambda: None)
    assert mgr.local_steps() == [1]
    assert "No space left on device" in mgr.write_error
    mgr.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_resume_is_bit_exact_after_a_signal_at_a_random_point(reference: tuple[str, Path], tmp_path: Path,
                                                              sig: signal.Signals) -> None:
    digest, _ = reference
    seed = random.SystemRandom().randrange(1 << 30)
    at = random.Random(seed).randint(6, 54)  # a step: before, between and around the checkpoints at 20 and 40
    args = [*ARGS, "--checkpoint-dir", str(tmp_path / "ck")]
    run = launch([*args, "--throttle-ms", "60"], tmp_path)
    run.wait_for(rf"step {at - at % 5} loss", timeout=120)
    if sig == signal.SIGTERM:
        os.kill(run.proc.pid, signal.SIGTERM)
    else:
        kill_tree(run.proc.pid)
    run.finish()
    again = launch(args, tmp_path)
    assert again.finish() == 0, f"seed {seed}, signal at step {at}:\n{again.output[-3000:]}"
    assert again.final()[2] == digest, f"seed {seed}, signal at step {at}"


def test_an_upload_that_finishes_while_the_close_stops_the_uploader_is_not_said_to_be_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A close that does not wait (`upload_deadline_s` 0) still lets the upload in flight finish
    while the uploader stops: that checkpoint is in the bucket, and no error says it was kept for
    a later run (it said "0 checkpoint(s) could not be uploaded: []")."""
    from training.ckpt import uploader as up

    gate, original = threading.Event(), up.Uploader._upload
    monkeypatch.setattr(up.Uploader, "_upload", lambda self, step: (gate.wait(30), original(self, step))[1])
    mgr = CheckpointManager(str(tmp_path / "disk"), f"file://{tmp_path / 'bucket'}", TOPO)
    stop = mgr.uploads.stop

    def stopping() -> None:  # the upload finishes in the stop's join
        gate.set()
        stop()

    monkeypatch.setattr(mgr.uploads, "stop", stopping)
    mgr.save(1, _state(1.0), {"x": torch.ones(1)}, lambda: None)
    status = mgr.close(timeout=0)
    assert status.uploaded == [1] and not status.pending
    assert (tmp_path / "bucket" / step_dir(1)).is_dir()
    assert "could not be uploaded" not in caplog.text
