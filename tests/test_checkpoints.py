"""Checkpoints a run can trust, tried as real processes (torchrun, gloo on CPU): damaged steps
are skipped for the previous good one (and refetched from the bucket when only the local copy
is bad), two runs never share a cache, a second trainer on a run is turned away, a bucket that
is down at start does not stop the run, and a resume under other settings is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TRAIN_ARGS
from tests.training_helpers import MotoServer, Proxy, launch, retry_until, storage_env
from training.ckpt.manager import MODEL_FILE, manifest_name, rng_name, run_key, step_dir

LAST = Path(step_dir(60))


def _flip_a_byte(folder: Path) -> None:
    path = folder / MODEL_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 tells
    path.write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    path = folder / MODEL_FILE
    path.write_bytes(path.read_bytes()[:1000])


def _break_the_header(folder: Path) -> None:
    """Garbage at the start of the archive, with a manifest that agrees (a bad write upstream):
    only the load itself can tell."""
    path = folder / MODEL_FILE
    data = bytearray(path.read_bytes())
    data[:64] = b"\0" * 64
    path.write_bytes(bytes(data))
    import hashlib

    manifest_path = folder / manifest_name(0)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][MODEL_FILE]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def _drop_the_manifest(folder: Path) -> None:
    (folder / manifest_name(0)).unlink()


def _wrong_manifest(folder: Path) -> None:
    manifest_path = folder / manifest_name(0)
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"][rng_name(1)]
    manifest_path.write_text(json.dumps(manifest))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "byte flipped": (_flip_a_byte, "model.pt does not match its digest"),
    "truncated": (_truncate, "model.pt has 1000 bytes, the manifest says"),
    "broken header": (_break_the_header, "model.pt cannot be read"),
    "wrong manifest": (_wrong_manifest, "the manifest lists no rng-rank00001.pt"),
    "missing manifest": (_drop_the_manifest, ""),  # not a committed step: never a candidate
}


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_a_damaged_newest_step_falls_back_to_the_previous_one(what: str, reference: tuple[str, Path],
                                                                tmp_path: Path) -> None:
    """The run resumes from step 40 instead and ends with the same parameters as a run that
    never stopped (training from 40 to 60 again is deterministic)."""
    digest, ck = reference
    shutil.copytree(ck, tmp_path / "ck", ignore=shutil.ignore_patterns(".lock"))
    damage, reason = DAMAGE[what]
    damage(tmp_path / "ck" / LAST)
    run = launch([*TRAIN_ARGS, "--checkpoint-dir", str(tmp_path / "ck")], tmp_path)
    assert run.finish() == 0, run.output[-3000:]
    if reason:
        line = run.wait_for(r"skipping checkpoint step 60: rank \d: ")
        assert reason in line, line
    run.wait_for(r"resumed from step 40 ")
    assert run.final() == (60, run.final()[1], digest)


def test_a_bad_local_copy_is_fetched_again_from_the_bucket(reference: tuple[str, Path], moto: MotoServer,
                                                            tmp_path: Path) -> None:
    digest, _ = reference
    env = storage_env(moto.url)
    args = [*TRAIN_ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-url", f"s3://{moto.bucket}/refetch/"]
    first = launch(args, tmp_path, env)
    assert first.finish() == 0 and first.final()[2] == digest, first.output[-3000:]
    local = tmp_path / "ck" / run_key(f"s3://{moto.bucket}/refetch/")
    _flip_a_byte(local / LAST)
    again = launch(args, tmp_path, env)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(r"local step-00000060 is damaged \(model.pt does not match its digest in the manifest\); fetching it "
                   r"from s3://")
    again.wait_for(r"run complete: checkpoint step 60 is at or past --steps 60")
    assert "final step=" not in again.output, "nothing is trained again"


def test_two_runs_never_share_a_cache_and_one_run_takes_one_trainer(moto: MotoServer, tmp_path: Path) -> None:
    env = storage_env(moto.url)
    first = launch([*TRAIN_ARGS, "--checkpoint-dir", f"s3://{moto.bucket}/run-x"], tmp_path, env)
    assert first.finish() == 0, first.output[-3000:]
    # slow enough that run-y cannot reach step 60 on its own before it is stopped, even on a loaded machine
    other = launch([*TRAIN_ARGS, "--checkpoint-dir", f"s3://{moto.bucket}/run-y", "--throttle-ms", "1000"],
                   tmp_path, env)
    other.wait_for(r"step 5 loss")
    assert "resumed" not in other.output, "a new run URL starts from scratch, not from run-x's steps"
    # A second trainer on run-y while it runs: turned away, naming the one that holds it.
    second = launch([*TRAIN_ARGS, "--checkpoint-dir", f"s3://{moto.bucket}/run-y"], tmp_path, env)
    assert second.finish() != 0
    line = second.wait_for(r"is in use by pid \d+ on .* since ")
    assert run_key(f"s3://{moto.bucket}/run-y") in line and "another trainer is on this run" in line
    os.kill(other.proc.pid, signal.SIGTERM)
    other.finish()
    assert not [k for k in moto.keys("run-y/") if k.startswith("run-y/step-00000060")], "run-y never got run-x's steps"


def test_a_bucket_down_at_start_does_not_stop_the_run(moto: MotoServer, tmp_path: Path) -> None:
    proxy = Proxy(moto.port)
    env = storage_env(f"http://127.0.0.1:{proxy.port}")
    args = [*TRAIN_ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-url", f"s3://{moto.bucket}/down/",
            "--upload-deadline-s", "60"]
    first = launch([*args, "--throttle-ms", "100"], tmp_path, env)
    first.wait_for(r"step 25 loss")
    os.kill(first.proc.pid, signal.SIGTERM)
    first.finish()
    stopped = int(first.wait_for(r"stopped by SIGTERM at step \d+").split("at step ")[1].split()[0])
    proxy.down()  # the bucket is unreachable when the run starts again
    again = launch([*args, "--throttle-ms", "100"], tmp_path, env)
    again.wait_for(r"the bucket s3://\S+ cannot be listed .*: starting from this node's own checkpoints", timeout=90)
    again.wait_for(rf"resumed from step {stopped} ")
    again.wait_for(r"step \d+ loss")
    proxy.up()  # back during the run: everything committed reaches the bucket
    assert again.finish() == 0, again.output[-3000:]
    assert retry_until(lambda: f"down/{step_dir(60)}/{manifest_name(0)}" in moto.keys("down/"), 30)
    proxy.down()


def test_a_resume_under_other_settings_is_refused_unless_asked(reference: tuple[str, Path], tmp_path: Path) -> None:
    _, ck = reference
    shutil.copytree(ck, tmp_path / "ck", ignore=shutil.ignore_patterns(".lock"))
    base = ["--workload", "tiny", "--checkpoint-every", "20", "--log-every", "5", "--checkpoint-dir", str(tmp_path / "ck")]
    done = launch([*base, "--steps", "40"], tmp_path)
    assert done.finish() == 0
    done.wait_for(r"run complete: checkpoint step 60 is at or past --steps 40; nothing to run")
    refused = launch([*base, "--steps", "80", "--lr", "0.02"], tmp_path)
    assert refused.finish() != 0
    line = refused.wait_for(r"run refused: checkpoint step 60 was trained with other settings")
    assert "steps=60 -> 80" in line and "lr=0.01 -> 0.02" in line and "--allow-config-change" in line
    allowed = launch([*base, "--steps", "80", "--allow-config-change"], tmp_path)
    assert allowed.finish() == 0, allowed.output[-3000:]
    allowed.wait_for(r"resuming step 60 with changed settings \(--allow-config-change\): steps=60 -> 80")
    assert allowed.final()[0] == 80
