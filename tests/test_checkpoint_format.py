"""Issue 34's fast paths keep every safety property: manifest format 2 (sha256 of 8 MiB pieces)
is checked as strictly as format 1 was, format-1 checkpoints still resume, a newer format is
refused by name, a download is hashed as it arrives and a flipped byte there still means the
previous step, a bucket that sends more than the manifest says is cut off, and a model built
on the meta device resumes to the very same numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training_helpers import MotoServer, storage_env
from training.ckpt import digest
from training.ckpt.manager import (MODEL_FILE, CheckpointError, CheckpointManager, Topology, manifest_name, sha256_of,
                                 step_dir)
from training.ckpt.checkpointer import choose_checkpoint
from training.distributed import Comm

TOPO = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((300, 300), value), "step": int(value)}


def _saved(root: Path, url: str | None, steps: tuple[int, ...] = (1, 2)) -> CheckpointManager:
    mgr = CheckpointManager(str(root), url, TOPO, keep=5)
    for step in steps:
        mgr.save(step, _state(float(step)), {"x": torch.ones(1)}, lambda: None)
    assert mgr.wait_uploads(60)
    return mgr


def _flip(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path, change: Any) -> None:
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_a_flipped_byte_in_a_format_2_file_means_the_previous_step(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "PIECE", 4096)  # many pieces: the bad one is in the middle
    mgr = _saved(tmp_path, None)
    manifest = json.loads((tmp_path / step_dir(2) / manifest_name(0)).read_text())
    assert manifest["format"] == 3 and digest.PIECES in manifest["files"][MODEL_FILE]
    _flip(tmp_path / step_dir(2) / MODEL_FILE, 200_000)
    with pytest.raises(CheckpointError, match="model.pt does not match its digest"):
        mgr.load(2)
    found = choose_checkpoint(mgr, Comm("torchrun"))
    assert found is not None and found.step == 1 and torch.equal(found.state["w"], torch.full((300, 300), 1.0))
    mgr.close()


# What earlier versions wrote: format 1, one whole-file sha256 per entry and no format field;
# format 2, sha256_pieces per entry (training/ckpt/digest.py). (format, digest kind) of each.
OLDER_FORMATS = {1: "sha256", 2: digest.SHA256_PIECES}


@pytest.mark.parametrize("version", sorted(OLDER_FORMATS))
def test_an_older_format_checkpoint_still_resumes_and_is_still_checked(tmp_path: Path, version: int) -> None:
    mgr = _saved(tmp_path, None, (3,))
    folder = tmp_path / step_dir(3)
    kind = OLDER_FORMATS[version]

    def to_older(manifest: dict[str, Any]) -> None:
        if version == 1:
            del manifest["format"]
        else:
            manifest["format"] = version
        manifest["files"] = {n: {"size": m["size"], kind: digest.hash_file(folder / n, kind)}
                             for n, m in manifest["files"].items()}
    _edit_manifest(folder / manifest_name(0), to_older)
    assert digest.hash_file(folder / MODEL_FILE, kind) != digest.hash_file(folder / MODEL_FILE)
    if version == 1:
        assert digest.hash_file(folder / MODEL_FILE, kind) == sha256_of(folder / MODEL_FILE)
    state, rng = mgr.load(3)
    assert state["step"] == 3 and rng is not None
    _flip(folder / MODEL_FILE)
    with pytest.raises(CheckpointError, match="model.pt does not match its digest"):
        mgr.load(3)
    mgr.close()


def test_a_newer_manifest_format_is_refused_by_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = _saved(tmp_path, None, (4,))
    _edit_manifest(tmp_path / step_dir(4) / manifest_name(0), lambda m: m.update(format=4))
    assert mgr.local_steps() == []
    assert "manifest format 4; this version of training/ reads formats 1 to 3" in caplog.text
    mgr.close()


@pytest.mark.parametrize("fault", ["flipped", "longer"])
def test_a_bad_file_in_the_bucket_means_the_previous_step(tmp_path: Path, fault: str) -> None:
    """file:// bucket: the fetch hashes what arrives; a flipped byte, or more bytes than the
    manifest lists, leaves nothing under the file's name and the step before is used."""
    bucket = tmp_path / "bucket"
    _saved(tmp_path / "writer", f"file://{bucket}").close()
    remote_file = next(bucket.glob(f"**/{step_dir(2)}/{MODEL_FILE}"))
    if fault == "flipped":
        _flip(remote_file)
    else:
        remote_file.write_bytes(remote_file.read_bytes() + b"x" * 10)
    reader = CheckpointManager(str(tmp_path / "reader"), f"file://{bucket}", TOPO)
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE} in file://"):
        reader.load(2)
    assert not (reader.local / step_dir(2) / MODEL_FILE).exists()
    found = choose_checkpoint(reader, Comm("torchrun"))
    assert found is not None and found.step == 1
    reader.close()


def test_a_download_from_s3_is_one_pass_and_a_flipped_byte_is_caught(tmp_path: Path, moto: MotoServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    url = f"s3://{moto.bucket}/format2"
    _saved(tmp_path / "writer", url).close()
    reader = CheckpointManager(str(tmp_path / "reader"), url, TOPO)
    reader.prefetch()  # what the trainer does while it builds the model
    state, _ = reader.load(2)
    assert torch.equal(state["w"], torch.full((300, 300), 2.0))
    reader.close()
    client = moto.client()
    key = f"format2/{step_dir(2)}/{MODEL_FILE}"
    data = bytearray(client.get_object(Bucket=moto.bucket, Key=key)["Body"].read())
    data[-100] ^= 0xFF
    client.put_object(Bucket=moto.bucket, Key=key, Body=bytes(data))
    other = CheckpointManager(str(tmp_path / "other"), url, TOPO)
    other.prefetch()
    found = choose_checkpoint(other, Comm("torchrun"))
    assert found is not None and found.step == 1
    other.close()


def test_a_model_built_on_the_meta_device_resumes_the_same_numbers(tmp_path: Path, signal_handlers: None) -> None:
    """The trainer's deferred init: no values until the checkpoint's, then exactly those; and
    without a checkpoint exactly the seed's values of a plain CPU build."""
    from training.trainer import config as config_mod
    from training.trainer.build import build_model
    from training.trainer.restore import restore_model
    from training.trainer.train import Run

    cfg = config_mod.parse(["--workload", "tiny", "--tiny-width", "48", "--checkpoint-dir", str(tmp_path / "c")])
    plain = build_model(cfg, 0)
    run = Run(cfg, Comm("torchrun"))
    run.build_model()
    assert run.deferred_init
    run.initialise()
    assert all(torch.equal(a, b) for a, b in zip(run.model.state_dict().values(), plain.state_dict().values()))
    after_plain_build = torch.rand(3)
    run.seed_streams()
    assert torch.equal(torch.rand(3), after_plain_build)  # initialise re-seeded the streams as a plain build does

    trained = {k: v + 1.5 for k, v in plain.state_dict().items()}
    resumed = Run(cfg, Comm("torchrun"))
    resumed.build_model()
    assert restore_model(resumed.model, resumed.optimizer, trained, resumed.deferred_init)
    assert all(torch.equal(resumed.model.state_dict()[k], v) for k, v in trained.items())
    # The loaded tensors themselves (no copy), and the optimizer steps them, not the empty ones.
    assert all(resumed.model.state_dict()[k].data_ptr() == v.data_ptr() for k, v in trained.items())
    stepped = [p for group in resumed.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in stepped] == [id(p) for p in resumed.model.parameters()]
    before = {k: v.clone() for k, v in trained.items()}
    resumed.model(torch.randn(4, cfg.tiny_dim)).sum().backward()
    resumed.optimizer.step()
    assert all(not torch.equal(v, before[k]) for k, v in resumed.model.named_parameters())


class _DroppingFs:
    """An fsspec-like store whose first `drops` reads of a file break after half of it, as a
    connection reset mid-stream does; later reads are whole. `answer` replaces the drop with
    an S3 answer (a dict like botocore's error response) to check what is not retried."""

    def __init__(self, data: bytes, drops: int, answer: dict[str, Any] | None = None):
        self.data, self.drops, self.answer, self.opens = data, drops, answer, 0

    def open(self, key: str, mode: str) -> Any:
        import io

        self.opens += 1
        fs, data = self, self.data

        class Reader(io.BytesIO):
            def read(self, n: int | None = -1) -> bytes:
                if fs.opens <= fs.drops and self.tell() >= len(data) // 2:
                    if fs.answer is not None:
                        err = OSError("refused")
                        err.response = fs.answer  # type: ignore[attr-defined]
                        raise err
                    raise ConnectionResetError("connection reset by peer")
                return super().read(n if n is not None and n >= 0 else -1)
        return Reader(data)


def _meta(data: bytes) -> dict[str, Any]:
    import hashlib

    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_download_that_drops_midway_is_fetched_again_and_a_bad_copy_is_not(tmp_path: Path) -> None:
    from training.ckpt.fetch import PIECE, fetch_retrying

    data = bytes(range(256)) * ((3 * PIECE) // 256)  # three pieces: the drop is after the first
    fs = _DroppingFs(data, drops=2)
    dest = tmp_path / "model.pt.part"
    fetch_retrying(fs, "b/k", dest, _meta(data), CheckpointError, wait_max_s=0)
    assert fs.opens == 3 and dest.read_bytes() == data

    always = _DroppingFs(data, drops=99)  # never whole: the last fault is raised, nothing is left
    with pytest.raises(ConnectionResetError):
        fetch_retrying(always, "b/k", dest, _meta(data), CheckpointError, attempts=3, wait_max_s=0)
    assert always.opens == 3 and not dest.exists()

    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    bad = _DroppingFs(bytes(flipped), drops=0)  # the bucket's copy is bad: once, not again
    with pytest.raises(CheckpointError, match="does not match its digest"):
        fetch_retrying(bad, "b/k", dest, _meta(data), CheckpointError, wait_max_s=0)
    assert bad.opens == 1 and not dest.exists()

    import tempfile  # an open file as the destination (the lone rank's memory file): each attempt from its start
    with tempfile.TemporaryFile() as held:
        dropping = _DroppingFs(data, drops=2)
        fetch_retrying(dropping, "b/k", held, _meta(data), CheckpointError, wait_max_s=0)
        held.seek(0)
        assert dropping.opens == 3 and held.read() == data
        longer = _DroppingFs(data + b"x" * 10, drops=0)
        with pytest.raises(CheckpointError, match="more than the"):
            fetch_retrying(longer, "b/k", held, _meta(data), CheckpointError, wait_max_s=0)
        held.seek(0, 2)
        assert held.tell() == 0  # emptied

    denied = _DroppingFs(data, drops=9, answer={"Error": {"Code": "AccessDenied", "Message": "no"}})
    with pytest.raises(OSError, match="refused"):  # an answer no retry changes: at once
        fetch_retrying(denied, "b/k", dest, _meta(data), CheckpointError, wait_max_s=0)
    assert denied.opens == 1


def test_the_peer_reader_runs_once_a_step_outside_the_buckets_retries(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """choose_checkpoint's `first` (the peer tier's collective reader) is tried once per step and
    never inside `load`'s retries: a rank retrying a bucket that did not answer must not enter the
    peer reader's collectives again while the other ranks are in the next one (issue 46 review)."""
    from training.ckpt import run_control
    from training.ckpt.storage import StorageUnavailable

    monkeypatch.setattr(run_control, "LOAD_WAIT_S", (0.0, 0.0))
    mgr = _saved(tmp_path, None)
    calls: list[str] = []

    def first(step: int) -> None:
        calls.append(f"peer {step}")
        return None  # the stores do not hold it: the durable tiers

    def load(step: int) -> tuple[Any, Any]:
        calls.append(f"load {step}")
        if calls.count(f"load {step}") == 1:
            raise StorageUnavailable("the bucket did not answer")
        return mgr.load(step)

    found = choose_checkpoint(mgr, Comm("torchrun"), load, first=first)
    assert found is not None and found.step == 2
    assert calls == ["peer 2", "load 2", "load 2"]

    calls.clear()
    found = choose_checkpoint(mgr, Comm("torchrun"), load, first=lambda step: ({"from": "peer"}, None))
    assert found is not None and found.step == 2 and found.state == {"from": "peer"} and calls == []
