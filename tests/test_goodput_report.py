"""`python -m training.goodput report`: a run with two reclaims, a hang and a straggler, written
as the writers write them (one object per writer, under the run's records/), gives the ETTR a
hand computation from the same timestamps gives; bad records are refused in one line; the
Daly interval and the simulator take the run's measured failure rate and checkpoint cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT
from training.records import Event

A, B = {"run": "r1", "team": "vision", "node": "a"}, {"run": "r1", "team": "vision", "node": "b"}
AGENT_A = [  # node a's entrypoint: capacity asked at 1000, booted 1100, gate passed 1200
    {**A, "t": 1000, "kind": "capacity_requested"}, {**A, "t": 1100, "kind": "node_booted", "node_hourly_usd": 2.0},
    {**A, "t": 1200, "kind": "gate_passed"}]
AGENT_B = [
    {**B, "t": 1000, "kind": "capacity_requested"}, {**B, "t": 1150, "kind": "node_booted", "node_hourly_usd": 3.0},
    {**B, "t": 1260, "kind": "gate_passed"}]


def _ckpt(t: float, step: int, blocked: float) -> dict[str, object]:
    return {**A, "t": t, "kind": "checkpoint", "step": step, "blocked_s": blocked}


TRAINER = [
    {**A, "t": 1300, "kind": "first_step", "step": 0},
    _ckpt(2300, 100, 10), _ckpt(3300, 200, 10),
    {**B, "t": 3800, "kind": "failure", "failure": "reclaim", "committed_step": 200},  # no notice: 3300-3800 lost
    {**A, "t": 4000, "kind": "first_step", "step": 200},
    _ckpt(5000, 300, 12),
    {**A, "t": 6500, "kind": "straggler", "rank": 1, "excess_s": 50.0, "step": 350},
    {**A, "t": 6700, "kind": "first_step", "step": 300},  # after the hang below (written by the watchdogs)
    _ckpt(7200, 400, 8), _ckpt(7290, 410, 5),  # the emergency checkpoint of a reclaim notice
    {**A, "t": 7300, "kind": "failure", "failure": "reclaim", "committed_step": 410},
    {**A, "t": 7500, "kind": "first_step", "step": 410},
    _ckpt(8990, 500, 6), {**A, "t": 9000, "kind": "run_finished", "step": 500}]
WATCHDOGS = [  # both nodes' watchdogs saw no step since 6000 and acted at 6100 and 6103
    {**B, "t": 6100, "kind": "failure", "failure": "hang", "rank": 1, "committed_step": 300, "last_progress_t": 6000,
     "detail": "suspect: node b rank 1"},
    {**A, "t": 6103, "kind": "failure", "failure": "hang", "rank": 0, "committed_step": 300, "last_progress_t": 6001,
     "detail": "peer: node a rank 0"}]


def by_hand() -> dict[str, float]:
    """The same timestamps, cut by hand into the report's categories (seconds)."""
    return {
        "waiting for capacity": 1150 - 1000,  # until the last first-round node booted
        "boot and gate": 1260 - 1150,
        "restart": (1300 - 1260) + (4000 - 3800) + (6700 - 6100) + (7500 - 7300),
        "hang": 6100 - 6000,
        "lost work": (3800 - 3300) + (6000 - 5000) + (7300 - 7290),
        "checkpoint stall": 10 + 10 + 12 + 8 + 5 + 6,
        "straggler": 50,
    }


T0 = 1_780_000_000  # the times above are seconds after this one (2026)


def lines(events: list[dict[str, object]]) -> str:
    """Events as a writer writes them, their times moved to T0 + t."""
    return "".join(json.dumps({**e, **{k: T0 + e[k] for k in ("t", "last_progress_t") if k in e}}) + "\n"  # type: ignore[operator]
                   for e in events)


def write_records(root: Path) -> Path:
    folder = root / "run" / "records"
    folder.mkdir(parents=True)
    for name, events in (("a-1-agent-1", AGENT_A), ("b-1-agent-1", AGENT_B), ("a-1-trainer-2", TRAINER),
                         ("b-1-watchdog-3", WATCHDOGS[:1]), ("a-1-watchdog-3", WATCHDOGS[1:])):
        (folder / f"{name}.jsonl").write_text(lines(events))
    return root / "run"


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "training.goodput", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_the_reports_ettr_is_the_hand_computed_one(tmp_path: Path) -> None:
    out = report("report", "--records", str(write_records(tmp_path)), "--format", "json")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    run = found["runs"]["r1"]
    hand = by_hand()
    total = 9000 - 1000
    ettr = (total - sum(hand.values())) / total
    assert run["ettr"] == pytest.approx(ettr, rel=0.01)
    for category, seconds in hand.items():
        assert run["badput_hours"][category] * 3600 == pytest.approx(seconds, abs=0.5), category
    assert run["hourly_usd"] == 5.0 and run["badput_usd"]["hang"] == pytest.approx(100 / 3600 * 5.0)
    assert run["hangs"] == ["hang of rank 1 on node b: 100 s without a step until detected"]
    assert len(run["failures"]) == 3 and run["stragglers"][0].startswith("rank 1: the run waited 50.0 s")
    assert found["teams"]["vision"]["ettr"] == pytest.approx(ettr, rel=0.01)
    text = report("report", "--records", str(tmp_path / "run"))
    assert text.returncode == 0 and "ETTR 62.4%" in text.stdout and "team vision" in text.stdout, text.stdout


def test_records_off_the_schema_are_refused_in_one_line(tmp_path: Path) -> None:
    root = write_records(tmp_path)
    (root / "records" / "c-1-trainer-9.jsonl").write_text(lines([{**A, "t": 5, "kind": "checkpoint", "step": 3}]))
    out = report("report", "--records", str(root))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "c-1-trainer-9.jsonl line 1" in out.stderr and "blocked_s" in out.stderr, out.stderr
    missing = report("report", "--records", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no records/ folder" in missing.stderr


def test_the_live_ettr_rules_compute_it_per_run_and_team(tmp_path: Path) -> None:
    """promtool evaluates the stack's recording rules on synthetic trainer series: run r1 (two nodes
    export it) kept 864 s of its 960 s, r2 384 of 480; the team's ETTR is over both (rules run each minute)."""
    import yaml

    from infra import monitoring
    from infra.stack.stackfile import load_stack_spec
    from tests.system_tools import debian_tool

    (tmp_path / "rules.yml").write_text(monitoring.render(load_stack_spec("dev")), encoding="utf-8")
    series = []
    for node, run, kept, started, team in (("0", "r1", 864, 0, "vision"), ("1", "r1", 850, 0, "vision"),
                                           ("2", "r2", 384, 480, "vision"), ("3", "r3", 600, 480, "audio")):
        labels = f'node="{node}",run="{run}",team="{team}"'
        series += [{"series": f"gts_run_productive_seconds{{{labels}}}", "values": f"{kept}x20"},
                   {"series": f"gts_run_started_timestamp_seconds{{{labels}}}", "values": f"{started}x20"}]
    tests = [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": monitoring.RUN_ETTR, "eval_time": "16m", "exp_samples": [
            {"labels": f'{monitoring.RUN_ETTR}{{run="r1",team="vision"}}', "value": 0.9},
            {"labels": f'{monitoring.RUN_ETTR}{{run="r2",team="vision"}}', "value": 0.8},
            {"labels": f'{monitoring.RUN_ETTR}{{run="r3",team="audio"}}', "value": 1}]},  # 600 s kept of 480: clamped
        {"expr": monitoring.TEAM_ETTR, "eval_time": "16m", "exp_samples": [
            {"labels": f'{monitoring.TEAM_ETTR}{{team="audio"}}', "value": 1},
            {"labels": f'{monitoring.TEAM_ETTR}{{team="vision"}}', "value": 1248 / 1440}]}]}]
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": tests}))
    done = subprocess.run([debian_tool("promtool", "prometheus"), "test", "rules", "t.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    panels = {p["title"]: p for p in monitoring.dashboard(load_stack_spec("dev"))["panels"]}
    ettr = panels["Effective training time ratio (ETTR) by run and team"]
    assert [t["expr"] for t in ettr["targets"]] == [monitoring.RUN_ETTR, monitoring.TEAM_ETTR]


def test_the_daly_interval_takes_the_runs_measured_rates(tmp_path: Path) -> None:
    """δ, M and R from the records above: 6 checkpoints, 3 failures in 8000 s, restarts of 200, 600, 200 s."""
    from training import goodput

    out = report("--records", str(write_records(tmp_path)), "--format", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    delta, mtbf, restart = (10 + 10 + 12 + 8 + 5 + 6) / 6, 8000 / 3, (200 + 600 + 200) / 3
    assert data["measured"]["checkpoint_cost_s"] == pytest.approx(delta)
    assert data["measured"]["mtbf_s"] == pytest.approx(mtbf)
    assert data["interval_s"] == pytest.approx(goodput.plan(delta, mtbf, restart).interval_s)
    flag = report("--records", str(tmp_path / "run"), "--mtbf", "3600", "--format", "json")
    assert json.loads(flag.stdout)["interval_s"] == pytest.approx(goodput.plan(delta, 3600, restart).interval_s)
    neither = report("--checkpoint-cost", "20")
    assert neither.returncode == 2 and "--mtbf is required (or --records URL" in neither.stderr


def test_the_peer_tier_on_the_spot_trace_keeps_95_percent() -> None:
    """tests/data/reclaims-spot-256-nodes.txt (synthesized from the published spot band, see its
    header): a bucket-only tier (60 s blocked, 15 min restart) stays under 95 % without notice;
    the peer tier (a copy every 50 steps of 2 s, 0.5 s, restart in 30 s) reaches it."""
    trace = str(ROOT / "tests/data/reclaims-spot-256-nodes.txt")
    args = ["--checkpoint-cost", "60", "--mtbf", "40500", "--restart-cost", "900", "--notice", "120", "--simulate",
            trace, "--peer", "50:2:0.5:30"]
    out = report(*args, "--format", "json")
    assert out.returncode == 0, out.stderr
    sim = json.loads(out.stdout)["simulation"]
    assert sim["reclaims"] == 300 and sim["without_notice"]["auto"] < 0.95
    assert sim["peer_tier"]["with_notice"] >= 0.95 and sim["peer_tier"]["without_notice"] >= 0.95
    text = report(*args)
    assert "assumptions: a copy in a peer's memory every 50 steps of 2 s" in text.stdout
    bad = report(*args[:-1], "50:2")
    assert bad.returncode == 2 and "--peer 50:2: STEPS:STEP_S:COST_S:RESTART_S" in bad.stderr


def test_two_writers_with_the_same_pid_and_boot_write_two_objects(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted container: its new pid namespace gives the trainer the pid the last one had,
    on the same boot. Each writer keeps its own object; no event is overwritten."""
    from training import records

    monkeypatch.setattr("os.getpid", lambda: 7)
    monkeypatch.setattr(records, "_boot_id", lambda: "b00t")
    monkeypatch.setenv("GTS_NODE_NAME", "node-a")
    for step in (0, 40):
        records.Writer(str(tmp_path), "trainer").emit("first_step", step=step)
    assert len(list((tmp_path / "records").iterdir())) == 2
    assert sorted(e.step or 0 for e in records.read(str(tmp_path))) == [0, 40]


@pytest.mark.parametrize("field, value, message", [
    ("blocked_s", float("nan"), "blocked_s: Input should be a finite number"),
    ("blocked_s", -3.0, "blocked_s: Input should be greater than or equal to 0"),
    ("step", -1, "step: Input should be greater than or equal to 0"),
    ("t", 1e12, "t: Value error, 1000000000000.0 is not a time between 2020-01-01 and a day from now"),
    ("t", 5, "t: Value error, 5.0 is not a time between 2020-01-01"),
])
def test_a_hostile_line_is_refused_by_name(field: str, value: float, message: str, tmp_path: Path) -> None:
    root = write_records(tmp_path)
    event = {**A, "t": T0 + 5, "kind": "checkpoint", "step": 3, "blocked_s": 1.0, field: value}
    (root / "records" / "c-1-trainer-9.jsonl").write_text(json.dumps(event) + "\n")  # NaN as json writes it
    out = report("report", "--records", str(root))
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert f"c-1-trainer-9.jsonl line 1: {message}" in out.stderr, out.stderr


def _events(*rows: dict[str, object]) -> list[Event]:

    return [Event.model_validate({**A, **row, "t": T0 + float(row["t"])}) for row in rows]  # type: ignore[arg-type]


START = ({"t": 0, "kind": "capacity_requested"}, {"t": 0, "kind": "node_booted", "node_hourly_usd": 1.0},
         {"t": 100, "kind": "agent_started"}, {"t": 200, "kind": "first_step", "step": 0})


def test_a_last_attempt_that_failed_loses_its_work_and_one_straggler_per_window_counts() -> None:
    """Never resumed after a crash at 1700: the work since the checkpoint at 1200 is lost (not
    productive). Ranks 1 and 2 flagged in the same window wait 50 s, not 80; a straggler inside the
    lost span is not counted twice."""
    from training.goodput_report import report_run

    run = report_run(_events(*START, {"t": 1100, "kind": "straggler", "rank": 1, "excess_s": 50.0, "step": 90},
                             {"t": 1100, "kind": "straggler", "rank": 2, "excess_s": 30.0, "step": 90},
                             {"t": 1200, "kind": "checkpoint", "step": 100, "blocked_s": 10},
                             {"t": 1500, "kind": "straggler", "rank": 1, "excess_s": 40.0, "step": 130},
                             {"t": 1700, "kind": "failure", "failure": "crash", "committed_step": 100}))
    hand = {"boot and gate": 100, "restart": 100, "checkpoint stall": 10, "lost work": 1700 - 1200, "straggler": 50}
    for category, seconds in hand.items():
        assert run.badput_hours[category] * 3600 == pytest.approx(seconds), category
    assert run.productive_hours * 3600 == pytest.approx(1700 - sum(hand.values()))


def test_a_resume_from_a_peer_copy_loses_only_the_work_after_it() -> None:
    """A bucket checkpoint at step 100 (1200), a peer copy at step 150 (1500, 1 s blocked), a reclaim
    at 1700, resumed from the peer copy's step: 200 s lost, not 500."""
    from training.goodput_report import report_run

    run = report_run(_events(*START, {"t": 1200, "kind": "checkpoint", "step": 100, "blocked_s": 10},
                             {"t": 1500, "kind": "checkpoint", "step": 150, "blocked_s": 1, "tier": "peer"},
                             {"t": 1700, "kind": "failure", "failure": "reclaim", "committed_step": 100},
                             {"t": 1800, "kind": "first_step", "step": 150},
                             {"t": 2800, "kind": "run_finished", "step": 300}))
    assert run.badput_hours["lost work"] * 3600 == pytest.approx(1700 - 1500)
    assert run.badput_hours["restart"] * 3600 == pytest.approx(100 + 100)


def test_the_trainer_records_its_peer_copies_as_checkpoints(tmp_path: Path) -> None:
    from training import records
    from training.trainer.progress import Progress

    class Rank0:
        rank, world, local_rank = 0, 1, 0

    class Peer:
        skipped = 0

        def copy(self, step: int, state: object, rng: object, budget_s: float | None = None) -> float:
            self.skipped += step == 20  # the second copy finds the first still on its way
            return 0.25

    progress = Progress(Rank0(), str(tmp_path), None)  # type: ignore[arg-type]
    for step in (10, 20):
        progress.peer_copy(Peer(), step, None, {})
    progress.close()
    found = [(e.kind, e.step, e.tier, e.blocked_s) for e in records.read(str(tmp_path))]
    assert found == [("checkpoint", 10, "peer", 0.25)]


def test_a_run_on_a_reused_node_starts_at_its_own_node_start(tmp_path: Path) -> None:
    """Nothing sets GTS_LAUNCH_TIME or GTS_BOOT_TIME and the machine booted long ago: its first run
    counts from the boot, a second run on the same boot from its own node-start, not the boot."""
    import os
    import time

    from training import records

    env = {k: v for k, v in os.environ.items() if k not in ("GTS_LAUNCH_TIME", "GTS_BOOT_TIME")}
    env.update(PYTHONPATH=str(ROOT), GTS_SCRATCH_DIR=str(tmp_path / "scratch"), GTS_NODE_NAME="n")
    (tmp_path / "scratch").mkdir()
    booted = records.boot_time()
    for run in ("first", "second"):
        before = time.time()
        done = subprocess.run([sys.executable, "-m", "training.records", "node-start"], cwd=ROOT, timeout=60,
                              env={**env, "GTS_RUN_ID": run, "CHECKPOINT_DIR": str(tmp_path / run)})
        assert done.returncode == 0
        starts = [e.t for e in records.read(str(tmp_path / run)) if e.kind in ("capacity_requested", "node_booted")]
        if run == "first":
            assert starts == [booted, booted]
        else:
            assert len(starts) == 2 and min(starts) >= before > booted


@pytest.mark.parametrize("stepped", [True, False])
def test_the_live_ettr_starts_at_the_runs_first_record_read_after_the_first_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stepped: bool) -> None:
    """The run's records are read once its first step is done (at the start the store's client
    and listing took CPU the resume needs), or RUN_STARTED_READ_S after the start when no step came
    (a long start, or one that dies first); the gauge then holds the run's first record's time."""
    import threading

    from training import records
    from training.trainer import progress as progress_mod
    from training.trainer.progress import Progress

    for var in ("GTS_PROGRESS_DIR", "STRAGGLER_WINDOW_STEPS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GTS_RUN_ID", "ettr-run")
    records.Writer(str(tmp_path), "node").emit("capacity_requested")  # (uploaded at once: not in the background)
    first = min(e.t for e in records.read(str(tmp_path)))
    read, real = [], records.read

    def reading(url: str) -> list[Event]:
        read.append(url)
        return real(url)

    monkeypatch.setattr(records, "read", reading)
    made: list[str] = []

    original = threading.Thread.__init__

    class Recorded(threading.Thread):  # which threads are made, and when (threading.Timer's own init calls this too)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(getattr(kwargs.get("target"), "__name__", ""))
            original(self, *args, **kwargs)

    monkeypatch.setattr(threading, "Thread", Recorded)

    class Gauge:
        value, set_now = None, threading.Event()

        def set(self, value: float) -> None:
            self.value = value
            self.set_now.set()

    class Metrics:
        run_started = Gauge()

    class Rank0:
        rank, world, local_rank, device = 0, 1, 0, None

    if not stepped:
        monkeypatch.setattr(progress_mod, "RUN_STARTED_READ_S", 0.0)
    progress = Progress(Rank0(), str(tmp_path), Metrics())  # type: ignore[arg-type]
    if stepped:
        assert "_run_started" not in made and Metrics.run_started.value is None  # nothing read at the start
        progress.stepped(1, 0.1, 0.1)
    assert Metrics.run_started.set_now.wait(60), "the records were never read"
    assert progress._run_timer is not None and progress._run_timer.finished.is_set()  # fired, or cancelled by the step
    progress.stepped(2 - stepped, 0.1, 0.1)  # the first step after the timer read them; a second step
    progress.close()
    assert Metrics.run_started.value == first and read == [str(tmp_path)] and made.count("_run_started") == 1  # once


def test_the_records_writer_opens_its_store_once_and_again_after_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every upload used to make a new store (a new S3 client, about 0.15 s of CPU beside the loop)."""
    from training import records
    from training.ckpt import storage

    made: list[storage.Location] = []

    def location(url: str) -> storage.Location:
        made.append(storage.location.__wrapped__(url))  # type: ignore[attr-defined]
        return made[-1]

    location.__wrapped__ = storage.location  # type: ignore[attr-defined]
    monkeypatch.setattr(storage, "location", location)
    writer = records.Writer(f"file://{tmp_path}", "trainer")
    for _ in range(3):
        writer.emit("first_step", step=0)
    first = made[0]
    assert made == [first] and writer._where is first and len(records.read(str(tmp_path))) == 3
    monkeypatch.setattr(first, "join", lambda *parts: (_ for _ in ()).throw(OSError("unreachable")))  # this store only
    writer.emit("first_step", step=1)  # refused: logged, kept for the next upload
    assert writer._where is None
    writer.emit("first_step", step=2)  # a new store, and every line
    assert writer._where is made[-1] is not first and len(records.read(str(tmp_path))) == 5
