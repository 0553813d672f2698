"""The recovery bench's own reading of the nodes' logs (training/trainer/bench_peer.py): the loss
counts as detected at the first survivor line of any kind that sees it, the lines taken from a
real run's logs (a spare waiting lets the agents restart before any worker failure is logged)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training.trainer.bench_peer import DETECTED, HANG, keep_hangs

SEEN = [
    "E1202 04:51:41.747000 2083 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002]"
    " failed (exitcode: 1) local_rank: 0 (pid: 2217) of binary: /work/main/.venv/bin/python",
    "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:17794: Connection reset by peer. This is typically caused by a remote worker hanging",
    "rdzv_launch: node 127.0.0.1_30177_0 is gone (its heartbeat is 3.1 s old and its peer store refuses connections): "
    "removed from the rendezvous now, not after the keep-alive limit",
]
NOT_SEEN = [
    "rdzv_launch: held as a spare: round 0 of the run is full (3 of 3 nodes); this node waits outside the run",
    "2026-12-02 04:48:59,797 rank0 gts.train resumed from step 140 (epoch 3, batch 14 of the epoch)",
    "W1202 04:48:45.722000 30205 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 30282 closing "
    "signal SIGTERM",
]


@pytest.mark.parametrize("line", SEEN)
def test_each_kind_of_survivor_line_is_a_detection(line: str) -> None:
    assert re.search(DETECTED, line)


@pytest.mark.parametrize("line", NOT_SEEN)
def test_a_line_that_does_not_see_the_loss_is_not_one(line: str) -> None:
    assert not re.search(DETECTED, line)


def test_a_hang_line_is_counted_and_its_stacks_are_kept_out_of_the_run_s_temporary_folder(tmp_path: Path) -> None:
    line = ("2026-12-02 04:50:00,456 gts.watchdog hang: no step on ranks [1] of node vm for 61 s (limit 60 s); "
            "suspect rank 1 (oldest heartbeat); saving stacks and restarting the workers")
    assert HANG in line
    work = tmp_path / "peer+spare-0"
    assert keep_hangs(work, tmp_path / "kept") is None  # no watchdog fired: nothing kept
    (work / "progress1" / "hangs").mkdir(parents=True)
    (work / "progress1" / "hangs" / "vm-1.txt").write_text("== rank 1 pid 5 last step 140\n  File train.py")
    kept = keep_hangs(work, tmp_path / "kept")
    assert kept is not None and (kept / "progress1" / "vm-1.txt").read_text().startswith("== rank 1")


def test_the_table_gives_where_the_recovery_time_goes(capsys: pytest.CaptureFixture[str]) -> None:
    """Each case's row and its breakdown (first worker up, restore, first step), min/median."""
    import argparse

    from training.trainer.bench_peer import _print

    row = {"detect": [1.0, 2.0], "to_step": [9.0, 11.0], "kill_to_step": [10.0, 13.0], "lost": [10.0, 10.0],
           "world": [2.0, 2.0], "hangs": [0.0, 0.0], "to_up": [4.0, 5.0], "up_to_resumed": [3.0, 4.0],
           "resumed_to_step": [2.0, 2.0], "blocked_share": [0.005, 0.006], "cold": [0.0, 1.0]}
    _print({"peer": row, "bucket": {}, "peer+spare": {}}, argparse.Namespace(width=64, every=20, repeats=2, gpt="512,6"))
    out = capsys.readouterr().out
    breakdown = [line for line in out.splitlines() if "first worker up" in line]
    assert len(breakdown) == 1 and breakdown[0].split()[0] == "peer"
    assert "4.00/4.50" in breakdown[0] and "3.00/3.50" in breakdown[0] and "2.00/2.00" in breakdown[0]
    assert breakdown[0].endswith("workers started cold 1")  # a warm start that fell back is counted, not hidden


def test_a_cold_start_line_is_the_one_the_client_prints() -> None:
    from training.trainer.bench_peer import COLD

    client = (Path(__file__).resolve().parents[1] / "training/node/warm_client.py").read_text()
    assert 'f"gts.warm: this worker starts cold: {why}"' in client and COLD == "gts.warm: this worker starts cold"


def test_the_sharded_cases_are_rows_with_their_own_blocked_share(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from training.trainer.bench_peer import CASES, _print

    assert {"sharded", "sharded-bucket"} <= set(CASES)
    row = {"detect": [1.0], "to_step": [5.0], "kill_to_step": [6.0], "lost": [10.0], "world": [2.0], "hangs": [0.0],
           "to_up": [2.0], "up_to_resumed": [2.0], "resumed_to_step": [1.0], "blocked_share": [0.004], "cold": [0.0]}
    _print({"sharded": row, "sharded-bucket": {**row, "lost": [50.0]}},
           argparse.Namespace(width=64, every=20, repeats=1, gpt="512,6"))
    out = capsys.readouterr().out
    rows: dict[str, str] = {}
    for line in out.splitlines():  # each case's first line is its row (its breakdown follows)
        if line.split() and line.split()[0] in CASES:
            rows.setdefault(line.split()[0], line)
    assert rows["sharded"].split()[-3] == "20" and rows["sharded-bucket"].split()[-3] == "-"  # K bounds the peer row only
    assert "sharded copies: loop blocked 0.40%/0.40% of step time at K=20" in out
