"""A stop (SIGTERM, a spot notice) saves its durable checkpoint first and only then sends a peer
copy, for a few seconds at most (STOP_PEER_S): a buddy gone without a reset must not eat the
stop's budget (docker stop gives 110 s) before the state is safe on disk (issue 46's review)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from tests.test_peer_store import KEY
from training.ckpt.manager import CheckpointManager, Topology
from training.distributed import Comm
from training.ckpt.peer.tier import PeerTier
from training.trainer.tracking import Tracker


class Recorder:
    """A peer tier stand-in that notes when it was asked for a copy, and how."""

    skipped = 0  # read by the trainer's progress, which records each copy sent

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def due(self, step: int) -> bool:
        return False

    def copy(self, step: int, state: Any, rng: Any, budget_s: float | None = None) -> float:
        self.events.append(f"peer {step} budget={budget_s}")
        return 0.0


def test_a_stop_saves_to_disk_before_it_sends_a_bounded_peer_copy(tmp_path: Path, signal_handlers: None) -> None:
    from training.trainer import config as config_mod
    from training.trainer.train import STOP_PEER_S, Run

    cfg = config_mod.parse(["--workload", "tiny", "--tiny-width", "48", "--steps", "50",
                            "--checkpoint-dir", str(tmp_path / "c")])
    run = Run(cfg, Comm("torchrun"))
    run.build_model()
    run.initialise()
    events: list[str] = []
    run.peer = Recorder(events)  # type: ignore[assignment]
    ckpt = CheckpointManager(str(tmp_path / "c"), None, Topology(0, 0, 1, 0, 1, 1), keep=2)
    real_save = ckpt.save

    def save(step: int, *args: Any, **kwargs: Any) -> float:
        events.append(f"durable {step}")
        return real_save(step, *args, **kwargs)
    ckpt.save = save  # type: ignore[method-assign]
    run.stop.raised = "SIGTERM"  # as the handler sets it: the loop stops after its next step
    try:
        assert run.loop(ckpt, Tracker(False, None, {})) == "SIGTERM"
    finally:
        ckpt.close(timeout=30)
    assert events == ["durable 1", f"peer 1 budget={STOP_PEER_S}"]


def test_a_stop_s_peer_copy_to_a_store_that_never_answers_gives_up_within_its_budget() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers (a buddy gone)
        store = f"127.0.0.1:{silent.getsockname()[1]}"
        tier = PeerTier(Comm("torchrun"), 10, KEY, store, "")
        tier.buddy = 0
        tier.copy(20, {"w": 1}, {"r": 2}, budget_s=0.2)
        assert tier._sender is not None and tier._sender.is_alive() and tier.sent == []  # returned, still sending
        tier.copy(30, {"w": 1}, {"r": 2}, budget_s=0.2)
        assert tier.skipped == 1  # the one before still on its way: this one is left out, not waited for


def test_every_node_s_copy_names_rank_0_s_mlflow_run(tmp_path: Path, signal_handlers: None) -> None:
    """A peer copy rank 0 restores may be another node's: its state must carry the run's MLflow
    id (rank 0's, gathered to every rank once the tracker is open), not that node's own tracker's
    (None on a node that started fresh), or each peer restore forks the MLflow run."""
    from training.trainer import config as config_mod
    from training.trainer.train import Run

    cfg = config_mod.parse(["--workload", "tiny", "--tiny-width", "48", "--checkpoint-dir", str(tmp_path / "c")])
    run = Run(cfg, Comm("torchrun"))
    run.build_model()
    run.initialise()
    run.run_id = "rank-0-run"  # as gathered from global rank 0
    state = run.state(Tracker(False, None, {}))  # this node's tracker is off and knows no run
    assert state is not None and state["mlflow_run_id"] == "rank-0-run"
