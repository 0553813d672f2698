"""The checkpoint library as one package (issue 45): training/ckpt/ holds it, the old flat import
paths users were told to use still give the very same objects, importing the package or its
storage module pulls in no torch (infra/ reads training/ckpt/storage.py while planning), and the
manager is composed of collaborators, not mixins, around one protocol for where a step comes from."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT
from training.ckpt.files import Topology
from training.ckpt.loader import Loader
from training.ckpt.manager import CheckpointManager
from training.ckpt.peer.tier import PeerTier
from training.ckpt.tiers import Tier
from training.ckpt.uploader import Uploader

# old path -> the module in training/ckpt/ it re-exports
SHIMS = {"training.checkpointing": "training.ckpt.checkpointer", "training.checkpoint": "training.ckpt.manager",
         "training.hf": "training.ckpt.hf", "training.lightning_spot": "training.ckpt.lightning",
         "training.sharded": "training.ckpt.sharded"}
# what docs/ and examples/ name at each old path
PUBLIC = {"training.checkpointing": {"Checkpointer"}, "training.checkpoint": {"CheckpointManager", "Topology"},
          "training.hf": {"SpotCheckpointCallback"}, "training.lightning_spot": {"SpotCheckpoint"},
          "training.sharded": {"ShardedCheckpoints", "full_params_sha256"}}


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_import_path_gives_the_same_objects(old: str) -> None:
    if old in ("training.hf", "training.lightning_spot"):
        pytest.importorskip("transformers" if old == "training.hf" else "lightning")
    shim, new = importlib.import_module(old), importlib.import_module(SHIMS[old])
    assert PUBLIC[old] <= set(dir(shim))
    assert shim is new  # the module itself: a patch of one of its names reaches the code that reads it
    # every public name the module had before the move (tests/data/ckpt_old_names.json, read at f721fd8)
    had = json.loads((ROOT / "tests" / "data" / "ckpt_old_names.json").read_text(encoding="utf-8"))[old]
    assert len(had) > 10 and [name for name in had if not hasattr(shim, name)] == []


def test_a_shim_is_a_few_lines_and_says_so() -> None:
    for old in SHIMS:
        text = (ROOT / (old.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 15 and "Compatibility" in text, old


def test_the_package_and_its_storage_import_no_torch() -> None:
    code = "import sys, training.ckpt, training.ckpt.storage; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_manager_holds_its_collaborators_and_inherits_nothing(tmp_path: Path) -> None:
    """CheckpointManager is composed (a Loader, an Uploader), not a chain of mixins (issue 45)."""
    assert CheckpointManager.__mro__ == (CheckpointManager, object)
    mgr = CheckpointManager(str(tmp_path), None, Topology(0, 0, 1, 0, 1, 1))
    assert isinstance(mgr.loader, Loader) and isinstance(mgr.uploads, Uploader)
    assert mgr.status is mgr.uploads.status and mgr.uploads.loader is mgr.loader


def test_the_disk_the_bucket_and_the_peer_tier_are_tiers(tmp_path: Path) -> None:
    """Each place a step comes from satisfies the one protocol (training/ckpt/tiers.py)."""
    mgr = CheckpointManager(str(tmp_path / "disk"), f"file://{tmp_path / 'bucket'}", Topology(0, 0, 1, 0, 1, 1))
    try:
        assert [t.name for t in mgr.tiers] == ["disk", "bucket"]
        assert all(isinstance(t, Tier) for t in mgr.tiers)
        assert isinstance(object.__new__(PeerTier), Tier)  # its members, without a world to gather
    finally:
        mgr.close()
    assert [t.name for t in CheckpointManager(str(tmp_path / "alone"), None, Topology(0, 0, 1, 0, 1, 1)).tiers] == ["disk"]


def test_the_tier_check_refuses_what_lacks_a_member() -> None:
    class ListsOnly:
        name = "half"

        def steps(self) -> set[int]:
            return set()
    assert not isinstance(ListsOnly(), Tier)


def test_the_managers_former_attributes_are_read_and_set_where_they_live(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), None, Topology(0, 0, 1, 0, 1, 1), keep=3, upload_attempts=4)
    seen: list[object] = []
    mgr.keep, mgr.attempts, mgr.on_status = 5, 2, seen.append
    assert (mgr.uploads.keep, mgr.uploads.attempts, mgr.uploads.on_status) == (5, 2, seen.append)
    assert (mgr.keep, mgr.attempts, mgr.on_status) == (5, 2, seen.append)
    mgr.remote_error = "listing refused"
    assert mgr.loader.remote_error == "listing refused" == mgr.remote_error


def test_each_tier_loads_a_committed_step_and_refuses_one_it_lacks(tmp_path: Path) -> None:
    import torch

    from training.ckpt.manager import CheckpointError

    topo, remote = Topology(0, 0, 1, 0, 1, 1), (tmp_path / "bucket").as_uri()
    writer = CheckpointManager(str(tmp_path / "disk"), remote, topo)
    writer.save(4, {"w": torch.arange(3)}, {"seed": torch.ones(1)}, lambda: None)
    assert writer.wait_uploads(120)
    for root in ("disk", "fresh"):  # the writer's disk holds the step; a fresh node's only the bucket
        mgr = writer if root == "disk" else CheckpointManager(str(tmp_path / root), remote, Topology(1, 1, 2, 0, 1, 2))
        try:
            assert [t.name for t in mgr.tiers] == ["disk", "bucket"]
            for tier in mgr.tiers:
                if tier.name == "disk" and root == "fresh":
                    assert tier.steps() == set()
                    with pytest.raises(CheckpointError):
                        tier.load(4)
                    continue
                assert 4 in tier.steps(), (root, tier.name)
                found = tier.load(4)
                assert found is not None and torch.equal(found[0]["w"], torch.arange(3)), (root, tier.name)
                with pytest.raises(CheckpointError):
                    tier.load(99)
        finally:
            mgr.close()
