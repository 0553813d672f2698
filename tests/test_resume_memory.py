"""Issue 34's resume at read speed: the only rank on its node resumes a step it lacks from memory
(training/ckpt/memory.py: received into a memory file, checked, mapped shared), and falls
back to disk wherever that is not safe; a trainer on a GPU maps a checked file from disk; the
model takes the loaded tensors (training/trainer/restore.py) where it can, and nothing of a
mapped checkpoint is held longer than the state needs it."""

from __future__ import annotations

import gc
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TRAIN_ARGS
from tests.test_checkpoint_format import TOPO, _edit_manifest, _saved
from tests.training_helpers import MotoServer, launch, storage_env
from training.ckpt import digest, memory as checkpoint_memory
from training.ckpt.manager import MODEL_FILE, CheckpointError, CheckpointManager, Topology, manifest_name, step_dir
from training.ckpt.checkpointer import choose_checkpoint
from training.distributed import Comm
from training.trainer.restore import own_moments, restore_model


def _memory_files() -> tuple[list[str], list[str]]:
    """This process's memory files from the checkpoint loader: (open descriptors, mappings)."""
    import gc

    gc.collect()  # what only unreachable cycles hold (an earlier test's objects) is not the loader's
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    mapped = Path("/proc/self/maps").read_text().splitlines()
    return [f for f in opened if "memfd:gts-" in f], [f for f in mapped if "memfd:gts-" in f]


@pytest.fixture
def bucket(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Steps 1 and 2 of a small state in the bucket (a prefix of this test's own)."""
    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    url = f"s3://{moto.bucket}/{tmp_path.name}"
    _saved(tmp_path / "writer", url).close()
    yield url


def _load_two(manager: CheckpointManager) -> dict[str, Any]:
    state, _ = manager.load(2)
    assert torch.equal(state["w"], torch.full((300, 300), 2.0))
    return state


def test_a_lone_rank_resumes_from_the_bucket_into_memory_and_holds_nothing_after(
        bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The only rank on its node fetches a step it lacks into a memory file and maps it: the
    tensors are the received pages (a shared mapping of the memory file, no descriptor left
    open, gone with the state), and nothing is written to its disk."""
    caplog.set_level("INFO", logger="gts.checkpoint")
    lone = CheckpointManager(str(tmp_path / "lone"), bucket, TOPO)
    state, rng = lone.load(2)
    assert torch.equal(state["w"], torch.full((300, 300), 2.0)) and rng is not None and torch.equal(rng["x"], torch.ones(1))
    opened, mapped = _memory_files()
    assert opened == [], opened  # the descriptors are closed: the mapping alone holds the pages
    assert mapped and all("memfd:gts-step-00000002-model.pt" in line and " rw-s " in line for line in mapped), mapped
    assert not (lone.local / step_dir(2)).exists()
    assert "fetched step-00000002 from s3://" in caplog.text and "into memory" in caplog.text
    state["w"].add_(1.0)  # training writes the loaded tensors in place: its own pages, no one else's
    del state, rng
    gc.collect()
    assert _memory_files() == ([], [])  # nothing held once the state is dropped
    lone.close()


def test_a_node_of_ranks_no_memory_files_or_too_little_memory_fetch_to_disk(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of two ranks fetches to disk (they share the copy); so does a lone rank where the
    system refuses a memory file, or where the step would take more than half the memory free."""
    pair = CheckpointManager(str(tmp_path / "pair"), bucket, Topology(0, 0, 2, 0, 1, 2))
    _load_two(pair)
    assert (pair.local / step_dir(2) / MODEL_FILE).stat().st_size > 0 and _memory_files() == ([], [])
    pair.close()

    def refused(name: str, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")
    with monkeypatch.context() as patch:
        patch.setattr(os, "memfd_create", refused)
        sandboxed = CheckpointManager(str(tmp_path / "sandboxed"), bucket, TOPO)
        _load_two(sandboxed)
        assert (sandboxed.local / step_dir(2) / MODEL_FILE).exists()
        sandboxed.close()

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_memory, "memory_room", lambda: 100_000)  # less than twice the step
        crowded = CheckpointManager(str(tmp_path / "crowded"), bucket, TOPO)
        _load_two(crowded)
        assert (crowded.local / step_dir(2) / MODEL_FILE).exists() and _memory_files() == ([], [])
        crowded.close()
    assert checkpoint_memory.memory_room() > 0  # this machine's own figure: its memory, or its cgroup's limit


def test_a_mapping_that_fails_reads_the_checked_bytes_and_a_bad_copy_leaves_no_memory_file(
        bucket: str, moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_load = torch.load

    def no_mapping(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("mmap"):
            raise RuntimeError("unable to mmap 360000 bytes: Cannot allocate memory (12)")
        return real_load(*args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "load", no_mapping)  # the bytes are checked: read them instead
        unmapped = CheckpointManager(str(tmp_path / "unmapped"), bucket, TOPO)
        state = _load_two(unmapped)
        assert _memory_files() == ([], []) and not (unmapped.local / step_dir(2)).exists()
        unmapped.close()
    del state

    client = moto.client()
    key = f"{tmp_path.name}/{step_dir(2)}/{MODEL_FILE}"
    data = bytearray(client.get_object(Bucket=moto.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=moto.bucket, Key=key, Body=bytes(data))
    damaged = CheckpointManager(str(tmp_path / "damaged"), bucket, TOPO)
    with pytest.raises(CheckpointError, match="model.pt in s3://.* does not match its digest either"):
        damaged.load(2)
    assert _memory_files() == ([], []) and not (damaged.local / step_dir(2)).exists()
    found = choose_checkpoint(damaged, Comm("torchrun"))
    assert found is not None and found.step == 1
    damaged.close()


def test_a_manifest_claiming_more_than_memory_holds_cannot_fill_it(bucket: str, moto: MotoServer, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A hostile (or damaged) manifest in the bucket says model.pt is a petabyte: the lone rank
    does not take that into memory (it would be OOM-killed on every restart); the disk path
    stops at what the store really sends, the step is refused and the one before is used."""
    import json

    client = moto.client()
    key = f"{tmp_path.name}/{step_dir(2)}/{manifest_name(0)}"
    manifest = json.loads(client.get_object(Bucket=moto.bucket, Key=key)["Body"].read())
    manifest["files"][MODEL_FILE]["size"] = 1 << 50
    client.put_object(Bucket=moto.bucket, Key=key, Body=json.dumps(manifest).encode())
    caplog.set_level("INFO", logger="gts.checkpoint")
    reader = CheckpointManager(str(tmp_path / "reader"), bucket, TOPO)
    with pytest.raises(CheckpointError, match=f"model.pt in s3://.* bytes arrived, the manifest says {1 << 50}"):
        reader.load(2)
    assert "needs 1073741824 MB, half of the" in caplog.text and "fetching it to disk" in caplog.text
    assert _memory_files() == ([], [])
    found = choose_checkpoint(reader, Comm("torchrun"))
    assert found is not None and found.step == 1
    reader.close()


def test_a_state_bound_for_an_accelerator_is_mapped_from_the_disk_not_read(tmp_path: Path) -> None:
    """`for_device` (the trainer on a GPU): a step on disk is checked, then its model file mapped
    privately, so the copy to the device is the only copy; a CPU run reads it (its steps write
    the tensors in place, which a mapping would pay for page by page)."""
    _saved(tmp_path, None).close()
    model_file = str(tmp_path / step_dir(2) / MODEL_FILE)

    def mappings() -> list[str]:
        return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(model_file)]

    gpu = CheckpointManager(str(tmp_path), None, TOPO, for_device=True)
    state, _ = gpu.load(2)
    assert torch.equal(state["w"], torch.full((300, 300), 2.0))
    assert mappings() and all(" r--p " in line or " rw-p " in line for line in mappings()), mappings()
    del state
    gc.collect()
    assert mappings() == []
    gpu.close()
    del gpu  # its lock on the run goes with it
    gc.collect()

    cpu = CheckpointManager(str(tmp_path), None, TOPO)
    state, _ = cpu.load(2)
    assert torch.equal(state["w"], torch.full((300, 300), 2.0)) and mappings() == []
    cpu.close()
    del cpu
    gc.collect()

    # A file torch cannot map (the old non-zip format, checked by its manifest all the same) is read.
    torch.save({"w": torch.full((300, 300), 2.0), "step": 2}, model_file, _use_new_zipfile_serialization=False)
    _edit_manifest(tmp_path / step_dir(2) / manifest_name(0),
                   lambda m: m["files"].update({MODEL_FILE: digest.entry(Path(model_file))}))
    old = CheckpointManager(str(tmp_path), None, TOPO, for_device=True)
    state, _ = old.load(2)
    assert torch.equal(state["w"], torch.full((300, 300), 2.0)) and mappings() == []
    old.close()


def test_a_model_with_a_shared_parameter_resumes_by_copy_and_keeps_it_shared(tmp_path: Path,
                                                                             signal_handlers: None) -> None:
    """Assigning the loaded tensors would give each of two modules sharing a parameter its own
    copy (and the optimizer one of them): such a model, or saved values of another type, are
    copied into the model instead."""
    from training.trainer import config as config_mod
    from training.trainer.train import Run

    cfg = config_mod.parse(["--workload", "tiny", "--tiny-width", "48", "--checkpoint-dir", str(tmp_path / "c")])
    run = Run(cfg, Comm("torchrun"))
    run.build_model()
    square = torch.nn.Linear(8, 8)
    shared = torch.nn.Sequential(square, torch.nn.Linear(8, 8))
    shared[1].weight = square.weight
    run.model, run.deferred_init = shared, True
    run.optimizer = torch.optim.AdamW(shared.parameters())
    saved = {k: torch.full_like(v, 2.0) for k, v in shared.state_dict().items()}
    assert not restore_model(run.model, run.optimizer, saved, run.deferred_init)
    assert shared[1].weight is square.weight and torch.equal(square.weight, torch.full((8, 8), 2.0))
    assert square.weight.data_ptr() != saved["0.weight"].data_ptr()  # copied, not assigned

    conv = torch.nn.Conv2d(4, 8, 3)
    run.model, run.deferred_init = conv, True
    run.optimizer = torch.optim.AdamW(conv.parameters())
    other_layout = {k: torch.ones_like(v).contiguous(memory_format=torch.channels_last) if v.dim() == 4
                    else torch.ones_like(v) for k, v in conv.state_dict().items()}
    assert other_layout["weight"].stride() != conv.weight.stride()
    assert not restore_model(run.model, run.optimizer, other_layout, run.deferred_init)
    assert conv.weight.is_contiguous() and torch.equal(conv.weight, torch.ones_like(conv.weight))

    plain = torch.nn.Linear(8, 8)
    run.model, run.deferred_init = plain, True
    run.optimizer = torch.optim.AdamW(plain.parameters())
    doubles = {k: torch.full_like(v, 3.0, dtype=torch.float64) for k, v in plain.state_dict().items()}
    assert not restore_model(run.model, run.optimizer, doubles, run.deferred_init)
    assert plain.weight.dtype == torch.float32 and torch.equal(plain.weight, torch.full((8, 8), 3.0))


def test_moments_restored_by_copy_own_their_storage_and_an_unchosen_prefetch_is_dropped(
        tmp_path: Path, signal_handlers: None) -> None:
    """When the model copies its weights, the optimizer's moments must not stay slices of one
    mapped checkpoint (they would keep the weights' part of it resident); and a prefetched step
    the ranks did not choose is not held once the run has resumed."""
    from training.trainer import config as config_mod
    from training.trainer.train import Run

    cfg = config_mod.parse(["--workload", "tiny", "--tiny-width", "48", "--checkpoint-dir", str(tmp_path / "c")])
    run = Run(cfg, Comm("torchrun"))
    run.build_model()
    params = list(run.model.parameters())
    whole = torch.zeros(sum(2 * p.numel() for p in params))  # one storage, as a mapped load gives
    offset = 0
    for param in params:
        moments = []
        for _ in range(2):
            moments.append(whole[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        run.optimizer.state[param] = {"step": torch.tensor(3.0), "exp_avg": moments[0], "exp_avg_sq": moments[1]}
    own_moments(run.optimizer)
    for values in run.optimizer.state.values():
        for value in values.values():
            assert value.untyped_storage().nbytes() == value.nbytes
            assert value.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() or value.dim() == 0

    _saved(tmp_path / "steps", None).close()
    mgr = CheckpointManager(str(tmp_path / "steps"), None, TOPO)
    mgr.prefetch()
    mgr.end_prefetch()
    assert mgr.loader.prefetched.thread is not None
    mgr.loader.prefetched.wait()
    assert mgr.loader.prefetched.found is None
    mgr.close()


def test_a_lone_process_resumes_from_the_bucket_through_memory_bit_identically(moto: MotoServer,
                                                                               tmp_path: Path) -> None:
    """One process on its node (a one-GPU node): the step it resumes is fetched into memory and
    mapped (no disk copy), the model takes the loaded tensors, and the run ends with the very
    parameters of an uninterrupted one-process run."""
    env = storage_env(moto.url)
    (tmp_path / "whole").mkdir()
    whole = launch([*TRAIN_ARGS, "--checkpoint-dir", str(tmp_path / "whole" / "ck")], tmp_path / "whole", nproc=1)
    assert whole.finish() == 0, whole.output[-3000:]
    args = [*TRAIN_ARGS, "--checkpoint-dir", f"s3://{moto.bucket}/run-lone"]
    run = launch([*args, "--throttle-ms", "100"], tmp_path, env, nproc=1)
    run.wait_for(r"uploaded step-00000020 ")
    os.kill(run.proc.pid, signal.SIGTERM)
    run.finish()
    stopped = int(run.wait_for(r"stopped by SIGTERM at step \d+").split("at step ")[1].split()[0])
    shutil.rmtree(tmp_path / "out")  # a new node
    again = launch(args, tmp_path, env, nproc=1)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(rf"fetched step-{stopped:08d} from s3://\S+ \(into memory")
    assert again.final()[2] == whole.final()[2]
    local = {p.name for p in (tmp_path / "out").rglob("step-*")}
    assert f"step-{stopped:08d}" not in local and "step-00000060" in local, local
