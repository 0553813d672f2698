"""Issue 46's fault: when nodes' checkpoint folders differ (each node's `model.pt` holds
something of its own), a node with an empty disk checked rank 0's file in the bucket against
another node's manifest entry, refused every step and started the run again over its history.
Each file is checked against the entry of the node that wrote it; and a run whose bucket holds
committed steps but can load none stops with one line instead of starting from step 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from training.ckpt.manager import MODEL_FILE, CheckpointManager, Topology, step_dir
from training.distributed import Comm
from training.ckpt.run_control import HistoryAtRisk, choose_checkpoint


def _topo(node: int) -> Topology:
    return Topology(rank=node, local_rank=0, world_size=2, node=node, nnodes=2, local_world_size=1)


def _state(step: int, node: int) -> dict[str, Any]:
    # The same weights on both nodes; something per node beside them (the trainer's stored config
    # holds the node's own checkpoint folder), so the nodes' model.pt files differ.
    return {"w": torch.full((64, 64), float(step)), "step": step, "config": {"checkpoint_dir": f"/scratch/node{node}"}}


def _two_nodes_saved(tmp_path: Path, steps: tuple[int, ...]) -> str:
    url = f"file://{tmp_path / 'bucket'}"
    managers = [CheckpointManager(str(tmp_path / f"node{n}"), url, _topo(n), keep=5) for n in (0, 1)]
    for step in steps:
        for node, mgr in enumerate(managers):
            mgr.save(step, _state(step, node), {"rank": torch.tensor([node])}, lambda: None)
    for mgr in managers:
        assert mgr.wait_uploads(60)
        mgr.close()
    return url


def test_a_node_with_an_empty_disk_loads_the_bucket_s_steps(tmp_path: Path) -> None:
    url = _two_nodes_saved(tmp_path, (10, 20))
    fresh = CheckpointManager(str(tmp_path / "replacement"), url, _topo(1), keep=5)  # node 1's place, nothing on disk
    try:
        model, rng = fresh.load(20)
        assert model["config"] == {"checkpoint_dir": "/scratch/node0"}  # global rank 0's file, the bucket's
        assert torch.equal(model["w"], torch.full((64, 64), 20.0)) and rng is not None and int(rng["rank"]) == 1
        found = choose_checkpoint(fresh, Comm("torchrun"))
        assert found is not None and found.step == 20
    finally:
        fresh.close()


def test_a_run_that_can_load_none_of_its_bucket_s_steps_stops_instead_of_overwriting(tmp_path: Path) -> None:
    url = _two_nodes_saved(tmp_path, (10, 20))
    for step in (10, 20):
        remote = tmp_path / "bucket" / step_dir(step) / MODEL_FILE
        data = bytearray(remote.read_bytes())
        data[-100] ^= 0xFF
        remote.write_bytes(bytes(data))
    fresh = CheckpointManager(str(tmp_path / "replacement"), url, _topo(1), keep=5)
    try:
        with pytest.raises(HistoryAtRisk, match=r"holds committed steps \[10, 20\] .* new checkpoint URL"):
            choose_checkpoint(fresh, Comm("torchrun"))
    finally:
        fresh.close()
    assert sorted(p.name for p in (tmp_path / "bucket").iterdir() if p.name.startswith("step-")) == [
        step_dir(10), step_dir(20)]
