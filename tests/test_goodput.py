"""The checkpoint interval and the goodput model: Daly's formula at several points (computed here
from the paper, not with the module), its degradation to Young's, the simulator's determinism,
and `auto` against fixed intervals on one long trace."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from training import goodput
from tests.harness import ROOT


def daly_by_hand(delta: float, m: float) -> float:
    """J. T. Daly, FGCS 22 (2006), eq. (37): the optimum compute time between dumps."""
    if delta >= 2 * m:
        return m
    ratio: float = delta / (2 * m)
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


@pytest.mark.parametrize("delta, m, expected", [
    (10.0, 3600.0, 261.70),       # 10 s checkpoint, hourly reclaims
    (60.0, 3600.0, 617.88),
    (3.1, 21600.0, 363.89),       # a 1 GB synchronous save, reclaims every 6 h
    (600.0, 86400.0, 9786.27),
    (1000.0, 400.0, 400.0),       # δ >= 2M: checkpoint every M
])
def test_the_interval_is_dalys(delta: float, m: float, expected: float) -> None:
    assert daly_by_hand(delta, m) == pytest.approx(expected, abs=0.01)
    assert goodput.daly_interval(delta, m) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("delta, m", [(0.01, 1e7), (1.0, 1e9)])
def test_it_degrades_to_youngs_when_checkpoints_are_cheap(delta: float, m: float) -> None:
    young = math.sqrt(2 * delta * m)
    assert goodput.young_interval(delta, m) == pytest.approx(young)
    assert goodput.daly_interval(delta, m) == pytest.approx(young, rel=2e-3)
    assert abs(goodput.daly_interval(1000, 3600) - math.sqrt(2 * 1000 * 3600)) > 100  # and not when they are not


def test_a_seeded_trace_gives_the_same_goodput_every_run() -> None:
    a, b = goodput.trace_times("weibull:0.7:3600:11"), goodput.trace_times("weibull:0.7:3600:11")
    assert a == b and len(a) == goodput.HORIZON_FAILURES
    assert goodput.trace_times("weibull:0.7:3600:12") != a
    first = goodput.simulate(a, 600, 20, 60, notice=120, seed=3)
    assert first == goodput.simulate(b, 600, 20, 60, notice=120, seed=3)


@pytest.mark.parametrize("notice", [0.0, 120.0])
def test_auto_is_at_least_every_fixed_interval_on_the_same_trace(notice: float) -> None:
    """A Poisson trace of 20000 reclaims (hourly): sampling noise is far below the differences
    between the sweep's intervals, which span 4x below and above the optimum."""
    times = goodput.trace_times("poisson:3600:5:20000")
    delta, restart = 20.0, 60.0
    auto = goodput.plan(delta, times[-1] / len(times), restart, notice).interval_s
    results = goodput.sweep(times, delta, restart, notice, [auto * f for f in (0.25, 0.5, 2.0, 4.0)] + [60, 7200])
    best_fixed = max(v for k, v in results.items() if k != "auto")
    assert results["auto"] >= best_fixed


@pytest.mark.parametrize("durable", [20.0, 60.0])  # committed = durable, or a 40 s upload after the commit
def test_the_model_and_the_simulator_agree(durable: float) -> None:
    times = goodput.trace_times("poisson:3600:9:20000")
    for notice in (0.0, 120.0):
        p = goodput.plan(20.0, 3600.0, 60.0, notice, durable)
        simulated = goodput.simulate(times, p.interval_s, 20.0, 60.0, notice, durable)
        assert simulated == pytest.approx(p.goodput, abs=0.01)


def test_an_upload_lag_costs_work_at_unannounced_failures() -> None:
    times = goodput.trace_times("poisson:3600:4:20000")
    prompt = goodput.simulate(times, 400.0, 20.0, 60.0, durable=20.0)
    lagging = goodput.simulate(times, 400.0, 20.0, 60.0, durable=200.0)
    assert lagging < prompt - 0.01
    assert goodput.plan(20.0, 3600.0, 60.0, durable=200.0).goodput < goodput.plan(20.0, 3600.0, 60.0).goodput


def test_a_notice_shorter_than_a_durable_checkpoint_does_not_count() -> None:
    short = goodput.plan(20.0, 3600.0, notice=10.0)
    none = goodput.plan(20.0, 3600.0)
    assert short.interval_s == none.interval_s and "shorter than a durable checkpoint" in short.why
    long = goodput.plan(20.0, 3600.0, notice=120.0)
    assert long.interval_s > 3 * none.interval_s and long.lost_work_per_reclaim_s < none.lost_work_per_reclaim_s


def test_the_command_prints_the_interval_and_simulates_a_file(tmp_path: Path) -> None:
    trace = tmp_path / "reclaims.txt"
    trace.write_text("2026-11-01T00:30:00Z\n2026-11-01T02:00:00Z\n2026-11-01T02:45:00Z\n2026-11-01T06:00:00Z\n")
    out = subprocess.run([sys.executable, "-m", "training.goodput", "--checkpoint-cost", "20", "--mtbf", "3600",
                          "--restart-cost", "60", "--notice", "120", "--simulate", str(trace), "--format", "json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["interval_s"] == pytest.approx(goodput.plan(20, 3600, 60, 120).interval_s)
    assert {"goodput", "lost_work_per_reclaim_s"} <= set(data)
    assert data["simulation"]["reclaims"] == 4 and set(data["simulation"]["with_notice"]) >= {"auto", "600 s"}
    bad = subprocess.run([sys.executable, "-m", "training.goodput", "--checkpoint-cost", "20", "--mtbf", "3600",
                          "--simulate", "weibull:0.7"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "SHAPE:SCALE" in bad.stderr
