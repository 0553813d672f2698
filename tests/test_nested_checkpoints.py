"""Checkpoint folders with subfolders (issue 32): what a Hugging Face Trainer writes under FSDP's
SHARDED_STATE_DICT (`pytorch_model_fsdp_0/` and `optimizer_0/`, each with DCP's `__0_0.distcp`
and hidden `.metadata`, beside `trainer_state.json` and `rng_state_0.pth`), made here with torch's
own distributed checkpoint in a one-process gloo group, committed through the manager and the
Hugging Face callback, its disk deleted, brought back byte-identical from the bucket and loaded
by DCP; a flipped byte in a nested file makes the step unusable; hostile nested names and
symbolic links are refused on commit and on load."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests.training_helpers import MotoServer, storage_env
from training.ckpt import storage
from training.ckpt.manager import CheckpointError, CheckpointManager, Topology, plain_path, tree_files

TOPO = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)
NESTED = ["optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata",
          "pytorch_model_fsdp_0/__0_0.distcp", "rng_state_0.pth", "trainer_state.json"]


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group, as the Trainer's accelerate would hold (DCP collectives run)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def trainer_folder(folder: Path, step: int) -> dict[str, torch.Tensor]:
    """A Trainer-like sharded checkpoint `folder` (real DCP writes); returns the saved weights."""
    model = _model(step)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    dcp_save({"model": model.state_dict()}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
    dcp_save({"optimizer": optim.state_dict()}, checkpoint_id=str(folder / "optimizer_0"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    torch.save({"cpu_rng_state": torch.get_rng_state()}, folder / "rng_state_0.pth")
    return {k: v.clone() for k, v in model.state_dict().items()}


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in tree_files(folder)}


def dcp_weights(folder: Path) -> dict[str, torch.Tensor]:
    target = {"model": _model(999).state_dict()}
    dcp_load(target, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
    return cast(dict[str, torch.Tensor], target["model"])


def test_a_sharded_trainer_folder_round_trips_through_the_bucket(gloo: None, tmp_path: Path) -> None:
    """Committed with its subfolders, uploaded under relative keys, the disk deleted: load_folder
    recreates the tree byte-identical and DCP loads the weights from it."""
    src = tmp_path / "checkpoint-5"
    saved = trainer_folder(src, 5)
    assert tree_files(src) == NESTED
    want = digests(src)
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    writer = CheckpointManager(str(tmp_path / "node"), url, TOPO, background=False)
    writer.save_folder(5, src, lambda: None)
    assert writer.close(timeout=60).uploaded == [5]
    manifest = json.loads((bucket / "step-00000005" / "manifest-node000.json").read_text())
    assert sorted(manifest["files"]) == NESTED
    assert (bucket / "step-00000005" / "pytorch_model_fsdp_0" / ".metadata").is_file()  # relative keys

    shutil.rmtree(tmp_path / "node")  # the node's disk is gone
    reader = CheckpointManager(str(tmp_path / "node"), url, TOPO)
    folder = reader.load_folder(5)
    reader.close(timeout=5)
    assert {k: v for k, v in digests(folder).items() if not k.startswith("manifest-node")} == want
    loaded = dcp_weights(folder)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), "DCP read other weights back"


def test_a_flipped_byte_in_a_nested_file_falls_back_through_the_hugging_face_resume(gloo: None,
                                                                                    tmp_path: Path) -> None:
    """hf.py's own on_save commits two steps of a Trainer folder with subfolders; a byte flipped in
    step 10's nested DCP file in the bucket (the disk deleted) makes resume() use step 5, whose
    weights DCP loads; a damaged local nested file is fetched again from the bucket."""
    from training.ckpt.hf import SpotCheckpointCallback

    url = f"file://{tmp_path / 'bucket'}"
    out = tmp_path / "out"
    spot = SpotCheckpointCallback(5, url=url, local_dir=str(tmp_path / "node"))
    saved = {}
    for step in (5, 10):
        saved[step] = trainer_folder(out / f"checkpoint-{step}", step)
        args, state = SimpleNamespace(output_dir=str(out)), SimpleNamespace(global_step=step)
        spot.on_save(cast(Any, args), cast(Any, state), cast(Any, SimpleNamespace()))
    assert spot.manager.wait_uploads(60)
    assert not (out / "checkpoint-10").exists()  # the callback keeps the committed copy only

    # A damaged local copy of a nested file: fetched again from the bucket, step 10 used.
    local = Path(spot.manager.local) / "step-00000010" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    local.write_bytes(bytes([local.read_bytes()[0] ^ 0xFF]) + local.read_bytes()[1:])
    resumed = spot.resume()
    assert spot.close() == 0
    assert resumed is not None and spot.resumed_step == 10
    assert all(torch.equal(dcp_weights(Path(resumed))[k], saved[10][k]) for k in saved[10])

    # A flipped byte in the bucket's copy and the node's disk gone: step 10 is unusable, step 5 is used.
    shutil.rmtree(tmp_path / "node")
    remote = tmp_path / "bucket" / "step-00000010" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data = bytearray(remote.read_bytes())
    data[len(data) // 2] ^= 0x01
    remote.write_bytes(bytes(data))
    fresh = SpotCheckpointCallback(5, url=url, local_dir=str(tmp_path / "node"))
    resumed = fresh.resume()
    fresh.close()
    assert resumed is not None and fresh.resumed_step == 5
    assert all(torch.equal(dcp_weights(Path(resumed))[k], saved[5][k]) for k in saved[5])


def test_subfolders_through_s3_keys_and_keep_k(moto: MotoServer, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a real S3 endpoint (moto): each nested file under its relative key, the tree
    fetched back into its subfolders, and keep-K removing whole steps, subfolders included."""
    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    url = f"s3://{moto.bucket}/nested"
    writer = CheckpointManager(str(tmp_path / "node"), url, TOPO, keep=1, background=False)
    for step in (5, 10):
        src = tmp_path / f"checkpoint-{step}"
        (src / "pytorch_model_fsdp_0").mkdir(parents=True)
        (src / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"meta %d" % step)
        (src / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(os.urandom(4096))
        (src / "trainer_state.json").write_text("{}")
        writer.save_folder(step, src, lambda: None)
        assert writer.wait_uploads(60)
    writer.close(timeout=60)
    keys = moto.keys("nested/")
    assert "nested/step-00000010/pytorch_model_fsdp_0/.metadata" in keys, keys
    assert not [k for k in keys if "step-00000005" in k], keys  # keep-K pruned the whole step
    assert [p.name for p in (tmp_path / "node").rglob("step-*")] == ["step-00000010"]
    shutil.rmtree(tmp_path / "node")
    reader = CheckpointManager(str(tmp_path / "node"), url, TOPO)
    folder = reader.load_folder(10)
    reader.close(timeout=5)
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").read_bytes() == b"meta 10"
    assert (folder / "pytorch_model_fsdp_0" / "__0_0.distcp").read_bytes() == \
        (tmp_path / "checkpoint-10" / "pytorch_model_fsdp_0" / "__0_0.distcp").read_bytes()


# ------------------------------------------------------------------ hostile nested names

HOSTILE_NESTED = ["a/../../x", "a//b", "/abs", "a/./b", "a/..", "./a", "a\\b", "a/b\x00", "a/b\n",
                  ".hidden", "a/.", "a/..", ".dir/x", "a/manifest-node000.json", "manifest-node001.json",
                  "/".join(["d"] * 9 + ["x"])]


@pytest.mark.parametrize("name", HOSTILE_NESTED)
def test_hostile_nested_names_are_not_plain_paths(name: str) -> None:
    assert not plain_path(name)


@pytest.mark.parametrize("name", ["pytorch_model_fsdp_0/.metadata", "optimizer_0/__0_0.distcp", "model.pt",
                                  "a/b/c/.metadata"])
def test_plain_nested_names_are_allowed(name: str) -> None:
    assert plain_path(name)


def _good_step(tmp_path: Path, url: str) -> None:
    src = tmp_path / "checkpoint-5"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / ".metadata").write_bytes(b"meta")
    (src / "trainer_state.json").write_text("{}")
    writer = CheckpointManager(str(tmp_path / "writer"), url, TOPO, background=False)
    writer.save_folder(5, src, lambda: None)
    assert writer.close(timeout=60).uploaded == [5]


@pytest.mark.parametrize("name", ["a/../../escape.pt", "a//escape.pt", "{tmp}/escape.pt", "a/./escape.pt",
                                  "a/manifest-node000.json"])
def test_a_bucket_manifest_listing_a_hostile_nested_name_is_refused(name: str, tmp_path: Path) -> None:
    """The manifest in the bucket edited to list a hostile nested name (size and sha256 of a file
    placed where it leads): the step is not complete, load_folder refuses it, nothing escapes."""
    name = name.format(tmp=tmp_path)
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    _good_step(tmp_path, url)
    payload = b"not yours"
    (bucket / "escape.pt").write_bytes(payload)
    loc = storage.location(url)
    key = loc.join("step-00000005", "manifest-node000.json")
    manifest = json.loads(loc.fs.cat(key))
    manifest["files"][name] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    loc.fs.pipe(key, json.dumps(manifest).encode())
    reader = CheckpointManager(str(tmp_path / "reader"), url, TOPO)
    assert reader.remote_steps() == []
    with pytest.raises(CheckpointError, match="not a plain file name inside the step's folder"):
        reader.load_folder(5)
    reader.close(timeout=5)
    assert not [p for p in (tmp_path / "reader").rglob("escape.pt")]
    assert not (tmp_path / "escape.pt").exists()


def test_a_symlinked_subfolder_is_refused_on_commit(tmp_path: Path) -> None:
    """A Trainer folder whose subfolder is a symbolic link (to anywhere): nothing is committed,
    the error names it; a symlinked file likewise."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    src = tmp_path / "checkpoint-5"
    src.mkdir()
    (src / "trainer_state.json").write_text("{}")
    os.symlink(outside, src / "pytorch_model_fsdp_0")
    manager = CheckpointManager(str(tmp_path / "node"), None, TOPO, background=False)
    with pytest.raises(CheckpointError, match="pytorch_model_fsdp_0 is a symbolic link"):
        manager.save_folder(5, src, lambda: None)
    (src / "pytorch_model_fsdp_0").unlink()
    (src / "sub").mkdir()
    os.symlink(outside / "secret", src / "sub" / "leaf")
    with pytest.raises(CheckpointError, match="sub/leaf is a symbolic link"):
        manager.save_folder(5, src, lambda: None)
    assert manager.local_steps() == []
    assert not [p for p in (tmp_path / "node").rglob("secret")]


@pytest.mark.parametrize("name", [".hidden", "sub/manifest-node000.json", "sp ace/x"])
def test_a_folder_holding_a_name_no_manifest_may_list_is_refused_on_commit(name: str, tmp_path: Path) -> None:
    src = tmp_path / "checkpoint-5"
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    (src / name).write_bytes(b"x")
    manager = CheckpointManager(str(tmp_path / "node"), None, TOPO, background=False)
    with pytest.raises(CheckpointError, match="not a plain file name a checkpoint may list"):
        manager.save_folder(5, src, lambda: None)
    assert manager.local_steps() == []


def test_a_symlinked_subfolder_on_the_local_disk_is_refused_on_load(tmp_path: Path) -> None:
    """A committed step whose subfolder is replaced on disk by a link elsewhere: load (and the
    download that follows) never reads or writes through it."""
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    _good_step(tmp_path, url)
    reader = CheckpointManager(str(tmp_path / "reader"), url, TOPO)
    folder = reader.load_folder(5)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(folder / "sub"), elsewhere)
    os.symlink(elsewhere, folder / "sub")
    with pytest.raises(CheckpointError, match="sub/.metadata is a symbolic link"):
        reader.load_folder(5)
    reader.close(timeout=5)
    assert (elsewhere / ".metadata").read_bytes() == b"meta"  # untouched
