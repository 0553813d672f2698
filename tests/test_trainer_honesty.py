"""A trainer that never hangs and never lies, tried as real processes: too little data, usage
errors, a checkpoint that cannot be written, a folder renamed past its manifest, refusals
through the entrypoint, a machine without nvidia-smi, SIGKILL of the entrypoint, and storage
that answers "no such bucket" or "access denied"."""

from __future__ import annotations

import fcntl
import hashlib
import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TRAIN_ARGS
from tests.training_helpers import BIN, ROOT, MotoServer, descendants, launch, retry_until, storage_env
from tests.test_user_code import start
from training.ckpt import storage
from training.ckpt.manager import CheckpointError, CheckpointManager, Topology, run_key

TOPO = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)

ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]
TWO = {"NPROC_PER_NODE": "2"}


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def quiet(output: str) -> None:
    """No traceback, not the launcher's nor a worker's."""
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]


def trainer(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "python"), "-m", "training.trainer.train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# ------------------------------------------------------------------ usage

def test_a_dataset_smaller_than_a_global_batch_is_refused_with_the_numbers(tmp_path: Path) -> None:
    run = start([*ENTRYPOINT, "--tiny-samples", "40", "--batch-size", "32", "--checkpoint-dir", str(tmp_path / "ck")],
                TWO, tmp_path)
    assert run.finish() == 2, run.output[-3000:]
    assert last_line(run.output) == ("entrypoint: refused: the dataset has 40 samples, fewer than one global batch "
                                     "(--batch-size 32 x 2 processes = 64): lower --batch-size or give it more data")
    quiet(run.output)


@pytest.mark.parametrize("args, env, named", [
    (["--batch-size", "0"], {}, "--batch-size=0: must be at least 1"),
    (["--lr", "-1"], {}, "--lr=-1.0: must be more than 0"),
    (["--steps", "ten"], {}, "--steps='ten': expected a whole number"),
    (["--checkpoint-dir", "{file}"], {}, "is a file, not a folder"),
    (["--checkpoint-dir", "{file}/sub"], {}, "is a file, not a folder"),
    ([], {"CHECKPOINT_EVERY": "garbage"}, "the environment variable CHECKPOINT_EVERY='garbage'"),
    ([], {"KEEP_CHECKPOINTS": "0"}, "the environment variable KEEP_CHECKPOINTS=0: must be at least 1"),
    (["--config", "{missing}"], {}, "--config"),
    (["--no-such-option"], {}, "unrecognized arguments: --no-such-option"),
])
def test_every_usage_error_is_one_line_and_exit_2(args: list[str], env: dict[str, str], named: str,
                                                  tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    args = [a.format(file=a_file, missing=tmp_path / "missing.yaml") for a in args]
    done = trainer(args, tmp_path, env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], done.stderr


def test_help_names_each_option_its_default_and_its_variable(tmp_path: Path) -> None:
    done = trainer(["--help"], tmp_path)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    from dataclasses import fields

    from training.trainer.config import FIELD_ENV, TrainConfig
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert f"[default: {f.default}" in text
    for name, var in FIELD_ENV.items():
        assert f"env {var}]" in text, var
    assert "per rank [default: 32]" in text  # the meaning, from the field's comment


# ------------------------------------------------------------------ the entrypoint

@pytest.mark.parametrize("env,named", [({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE"),
                                       ({"NNODES": "2;id"}, "NNODES"), ({"MIN_NNODES": "-1"}, "MIN_NNODES")])
def test_the_entrypoint_refuses_counts_that_are_not_counts(env: dict[str, str], named: str, tmp_path: Path) -> None:
    run = start([*ENTRYPOINT, "--steps", "6"], env, tmp_path)
    assert run.finish() == 2, run.output
    # the contract check at container start (training/contract.py) refuses it before any launcher runs
    assert f"trainer contract: {named}=" in run.output and "a whole number of at least 1" in run.output
    assert "torchrun" not in run.output


def test_the_entrypoint_runs_without_nvidia_smi_and_its_help_shows_both_usages(tmp_path: Path) -> None:
    path = f"{BIN}:/usr/bin:/bin"
    assert shutil.which("nvidia-smi", path=path) is None
    helped = start([*ENTRYPOINT, "--help"], {}, tmp_path)
    assert helped.finish() == 0, helped.output
    assert "usage: training/node/entrypoint.sh" in helped.output and "usage: python -m training.trainer.train" in helped.output
    assert "env CHECKPOINT_EVERY]" in helped.output

    run = start([*ENTRYPOINT, "--steps", "6", "--checkpoint-every", "3", "--checkpoint-dir", str(tmp_path / "ck")], {},
                tmp_path)
    assert run.finish() == 0, run.output[-3000:]
    assert run.output.count("no GPU listed by nvidia-smi: one training process") == 1
    run.wait_for(r"rank 0 of 1 \(node 0 of 1\)")
    run.wait_for(r"^final step=6 ")


def test_sigkill_of_the_entrypoint_takes_the_launcher_and_workers_with_it(tmp_path: Path) -> None:
    run = start([*ENTRYPOINT, *TRAIN_ARGS, "--steps", "100000", "--throttle-ms", "50", "--checkpoint-dir",
                 str(tmp_path / "ck")], TWO, tmp_path)
    below: list[int] = []
    try:
        run.wait_for(r"step 10 loss", timeout=120)
        below = descendants(run.proc.pid)
        assert len(below) >= 4, below  # guard, torchrun, two workers
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=10)

        def gone() -> bool:
            return not [pid for pid in below if Path(f"/proc/{pid}").exists() and
                        Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"]
        assert retry_until(gone, timeout=60), [Path(f"/proc/{p}/cmdline").read_bytes() for p in below
                                               if Path(f"/proc/{p}").exists()]
    finally:
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_lock_and_drift_refusals_are_the_last_line_not_a_traceback(reference: tuple[str, Path],
                                                                       tmp_path: Path) -> None:
    _, ref_dir = reference
    shutil.copytree(ref_dir, tmp_path / "ck")
    drift = start([*ENTRYPOINT, *TRAIN_ARGS, "--steps", "80", "--lr", "0.02", "--checkpoint-dir", str(tmp_path / "ck")],
                  TWO, tmp_path)
    assert drift.finish() == 2, drift.output[-3000:]
    assert last_line(drift.output).startswith("entrypoint: run refused: checkpoint step 60 was trained with other "
                                              "settings (steps=60 -> 80, lr=0.01 -> 0.02)")
    quiet(drift.output)

    with (tmp_path / "ck" / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.seek(0)
        held.truncate()
        held.write("pid 1 on the-other-trainer\n")
        held.flush()
        locked = start([*ENTRYPOINT, *TRAIN_ARGS, "--steps", "80", "--checkpoint-dir", str(tmp_path / "ck")], TWO,
                       tmp_path)
        assert locked.finish() == 2, locked.output[-3000:]
    assert last_line(locked.output) == (f"entrypoint: {tmp_path / 'ck'} is in use by pid 1 on the-other-trainer: "
                                        "another trainer is on this run. Stop it, or give this one another "
                                        "--checkpoint-dir / checkpoint URL")
    quiet(locked.output)


# ------------------------------------------------------------------ checkpoints that do not lie

def test_a_final_checkpoint_that_cannot_be_written_fails_the_run(tmp_path: Path) -> None:
    run = launch([*TRAIN_ARGS, "--checkpoint-dir", str(tmp_path / "ck")], tmp_path,
                 env={"GTS_TEST_DISK_FULL_STEP": "60"})
    assert run.finish() == 1, run.output[-3000:]
    assert "final step=" not in run.output
    run.wait_for(r"the run reached its end at step 60, but its checkpoint could not be written \(step-00000060: the disk "
                 rf"holding {tmp_path / 'ck'} \(the file system mounted at /\S*\) is full: the step needed about "
                 r"\d+\.\d [KM]iB, .* free \(OSError: \[Errno 28\] No space left on device\)")
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-00000020", "step-00000040"]


def test_a_folder_renamed_past_its_manifest_is_not_a_checkpoint(reference: tuple[str, Path], tmp_path: Path) -> None:
    """step-00000040 copied to step-00000999 (step 60 gone): the run is not "complete"; it
    resumes from 40 and ends where the uninterrupted run ended."""
    digest, ref_dir = reference
    ck = tmp_path / "ck"
    shutil.copytree(ref_dir, ck)
    shutil.rmtree(ck / "step-00000060")
    shutil.copytree(ck / "step-00000040", ck / "step-00000999")
    run = launch([*TRAIN_ARGS, "--checkpoint-dir", str(ck)], tmp_path)
    assert run.finish() == 0, run.output[-3000:]
    run.wait_for(r"step-00000999/manifest-node000.json is the manifest of step 40, not of step-00000999")
    run.wait_for(r"resumed from step 40\b")
    assert run.final()[0] == 60 and run.final()[2] == digest


# ------------------------------------------------------------------ storage that says no

class Denying(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint whose every answer is 403 AccessDenied (credentials without the right)."""

    def _deny(self) -> None:
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                b"<Message>Access Denied</Message></Error>")
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _deny

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def denying() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Denying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("store, cause", [("moto", "NoSuchBucket"), ("denying", "AccessDenied")])
def test_a_permanent_storage_error_fails_at_once_with_the_url_and_cause(store: str, cause: str, moto: MotoServer,
                                                                        denying: str, tmp_path: Path) -> None:
    endpoint = moto.url if store == "moto" else denying
    url = "s3://no-such-bucket-here/runs/a"
    run = start([*ENTRYPOINT, *TRAIN_ARGS, "--checkpoint-dir", url], {**TWO, **storage_env(endpoint)}, tmp_path)
    assert run.finish() == 2, run.output[-3000:]
    line = last_line(run.output)
    assert line.startswith(f"entrypoint: refused: checkpoint storage {url}: {cause}: "), line
    assert "step 5 loss" not in run.output  # nothing trained
    quiet(run.output)
    assert not (tmp_path / "out" / "checkpoint-cache" / run_key(url) / "step-00000005").exists()


HOSTILE = ["../escape.pt", "{tmp}/absolute.pt", "nested/../../escape.pt", "..", ".hidden", "manifest-node001.json"]


def _hostile_bucket(tmp_path: Path, url: str, loc_root: Path | None, name: str, folder: bool) -> None:
    """A good step 5 in the bucket, then its manifest edited to list `name` as well (with the
    size and sha256 of a file placed where the name leads, so only the name can give it away)."""
    import json

    import torch

    writer = CheckpointManager(str(tmp_path / "writer"), url, TOPO, background=False)
    if folder:  # what the Hugging Face callback commits: a Trainer's checkpoint folder
        src = tmp_path / "checkpoint-5"
        src.mkdir()
        (src / "trainer_state.json").write_text("{}")
        writer.save_folder(5, src, lambda: None)
    else:
        writer.save(5, {"w": torch.ones(3)}, {"x": torch.ones(1)}, lambda: None)
    assert writer.close(timeout=60).uploaded == [5]
    payload = b"not yours"
    entry = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    location = storage.location(url)
    key = location.join("step-00000005", "manifest-node000.json")
    manifest = json.loads(location.fs.cat(key))
    manifest["files"][name] = entry
    location.fs.pipe(key, json.dumps(manifest).encode())
    if loc_root is not None:
        (loc_root / "escape.pt").write_bytes(payload)


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("path", ["load", "load_folder"])
def test_hostile_manifest_names_never_leave_the_step_folder(path: str, name: str, tmp_path: Path) -> None:
    """Both download paths (the manager's load, and load_folder: the Hugging Face resume) with a
    bucket whose manifest names '..', an absolute path, a nested path, a dot file or another
    node's manifest: the step is refused and nothing is written outside its folder."""
    name = name.format(tmp=tmp_path)
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    _hostile_bucket(tmp_path, url, bucket, name, folder=path == "load_folder")
    reader = CheckpointManager(str(tmp_path / "reader"), url, TOPO)
    assert reader.remote_steps() == []  # not a complete step either
    with pytest.raises(CheckpointError, match="not a plain file name inside the step's folder"):
        getattr(reader, path)(5)
    reader.close(timeout=5)
    written = {p.name for p in (tmp_path / "reader").rglob("*") if p.is_file()}
    assert not written & {"escape.pt", "absolute.pt", ".hidden"}, written
    assert not (tmp_path / "absolute.pt").exists()


def test_hostile_manifest_through_s3_and_the_hugging_face_resume(moto: MotoServer, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through a real S3 endpoint and hf.py's own resume (a real process)."""
    url = f"s3://{moto.bucket}/hostile"
    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    _hostile_bucket(tmp_path, url, None, "../escape.pt", folder=True)
    code = ("from training.ckpt.hf import SpotCheckpointCallback\n"
            f"print('resume:', SpotCheckpointCallback(url={url!r}, local_dir={str(tmp_path / 'node')!r}).resume())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resume: None" in done.stdout
    assert "lists '../escape.pt': not a plain file name inside the step's folder" in done.stderr
    assert not [p for p in (tmp_path / "node").rglob("escape.pt")]
