"""A run's effective training time ratio (ETTR) and where the rest went, from its records
(training/records.py), in hours and dollars, per run and per team:

    python -m training.goodput report --records s3://bucket/checkpoints/run-1/ [--format json]

The run's wall time runs from its first capacity request to its end (`run_finished`, else its
last record) and is cut into:

- waiting for capacity: from the first request to the last first-round node's boot;
- boot and gate: from that boot to the last GPU gate passed or node agent (entrypoint) started;
- restart: from the gate (or a failure) to the first step of the attempt that follows (launch,
  rendezvous, restore; a replacement node's wait for capacity falls here too);
- hang: from the last step any rank finished to the watchdog's detection;
- lost work: from the checkpoint the next attempt resumed from (a bucket checkpoint or a peer
  copy) to the failure (for a hang: to the last step), less the checkpoint stalls in it; a last
  attempt that failed and never resumed: from its newest checkpoint, and what follows the failure
  until the end counts as restart;
- checkpoint stall: each checkpoint's loop-blocked time;
- straggler: the time the run waited for flagged slow ranks (per window the largest excess
  compute over the median, none inside lost work);

productive time is what is left, and ETTR = productive / wall. Dollars are those hours at the
run's hourly price: the sum of its first-round nodes' NODE_HOURLY_USD (the plan's price from the
catalog, infra/data/prices.csv), or --hourly-usd.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from training.records import Event

CATEGORIES = ("waiting for capacity", "boot and gate", "restart", "hang", "lost work", "checkpoint stall", "straggler")


@dataclass
class RunReport:
    run: str
    team: str
    nodes: int
    hourly_usd: float
    total_hours: float = 0.0
    productive_hours: float = 0.0
    ettr: float = 0.0
    badput_hours: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    badput_usd: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    stragglers: list[str] = field(default_factory=list)
    finished: bool = False
    measured: dict[str, float] = field(default_factory=dict)  # for the Daly interval (training/goodput.py)


@dataclass
class Incident:
    t: float  # when the failure was noticed
    kind: str
    work_end: float  # when the last kept-or-lost step ended (a hang: the last step)
    who: str


def incidents(failures: list[Event], first_steps: list[Event], events: list[Event]) -> list[Incident | None]:
    """The failure that ended each attempt but the last (None: the attempt ended unrecorded)."""
    out: list[Incident | None] = []
    for begin, after in zip(first_steps, first_steps[1:]):
        inside = [f for f in failures if begin.t < f.t <= after.t]
        if not inside:
            last = max((e.t for e in events if begin.t <= e.t < after.t), default=begin.t)
            out.append(Incident(last, "crash (unrecorded)", last, ""))
            continue
        hangs = [f for f in inside if f.failure == "hang" and f.last_progress_t is not None]
        first = min(inside, key=lambda f: f.t)
        if hangs:
            suspect = next((h for h in hangs if h.detail.startswith("suspect")), hangs[0])
            who = f"rank {suspect.rank} on node {suspect.node}"
            work_end = min(h.last_progress_t for h in hangs if h.last_progress_t is not None)
            out.append(Incident(min(h.t for h in hangs), "hang", work_end, who))
        else:
            out.append(Incident(first.t, str(first.failure), first.t, first.node))
    return out


def _stalls(checkpoints: list[Event], start: float, end: float) -> float:
    return sum(c.blocked_s or 0.0 for c in checkpoints if start < c.t <= end)


def _start_segments(events: list[Event], start: float, first: float) -> dict[str, float]:
    booted = [e.t for e in events if e.kind == "node_booted" and e.t <= first]
    gates = [e.t for e in events if e.kind in ("gate_passed", "agent_started") and e.t <= first]
    boot = min(max(max(booted, default=start), start), first)
    gate = min(max(max(gates, default=boot), boot), first)
    return {"waiting for capacity": boot - start, "boot and gate": gate - boot, "restart": first - gate}


def _last_incident(failures: list[Event], begin: Event, end: float) -> Incident | None:
    """The failure that ended the last attempt, which nothing resumed (None: it ran to the end)."""
    after = [f for f in failures if begin.t < f.t <= end]
    return incidents(after, [begin, Event(t=end, kind="first_step", run=begin.run, step=0)], after)[0] if after else None


def _attempts(report: RunReport, events: list[Event], seconds: dict[str, float], end: float) -> list[tuple[float, float]]:
    """Badput of the attempts: stalls, lost work, hangs and restarts; the lost spans."""
    firsts = [e for e in events if e.kind == "first_step"]
    checkpoints = [e for e in events if e.kind == "checkpoint"]
    failures = [e for e in events if e.kind == "failure"]
    ends = incidents(failures, firsts, events)
    if firsts and not report.finished:  # the last attempt's failure, never resumed: its work is lost too
        ends.append(_last_incident(failures, firsts[-1], end))
    restarts, spans = [], []
    for i, begin in enumerate(firsts):
        incident = ends[i] if i < len(ends) else None
        stop = incident.t if incident else end
        seconds["checkpoint stall"] += _stalls(checkpoints, begin.t, stop)
        if incident is None:
            continue
        resumed = firsts[i + 1].step if i + 1 < len(firsts) else None
        # what the next attempt resumed from (a bucket or a peer copy); the last one: the newest saved
        commits = [c.t for c in checkpoints if resumed in (c.step, None) and begin.t < c.t <= incident.work_end]
        kept_until = max(max(commits, default=begin.t), begin.t)
        lost = max(0.0, incident.work_end - kept_until - _stalls(checkpoints, kept_until, incident.work_end))
        spans.append((kept_until, incident.work_end))
        seconds["lost work"] += lost
        seconds["hang"] += incident.t - incident.work_end
        restart = (firsts[i + 1].t if i + 1 < len(firsts) else end) - incident.t
        seconds["restart"] += restart
        restarts.append(restart)
        line = (f"{incident.kind} at +{(incident.t - events[0].t) / 3600:.3f} h: {lost:.0f} s of work lost, "
                + (f"restart {restart:.0f} s, resumed from step {resumed}" if resumed is not None else "not resumed"))
        report.failures.append(line + (f" ({incident.who})" if incident.who else ""))
        if incident.kind == "hang":
            report.hangs.append(f"hang of {incident.who}: {incident.t - incident.work_end:.0f} s without a step "
                                f"until detected")
    blocked = [c.blocked_s or 0.0 for c in checkpoints]
    report.measured = {"failures": float(len([e for e in ends if e is not None])),
                       "checkpoint_cost_s": statistics.mean(blocked) if blocked else 0.0,
                       "restart_cost_s": statistics.mean(restarts) if restarts else 0.0}
    return spans


def _stragglers(report: RunReport, events: list[Event], lost: list[tuple[float, float]]) -> float:
    """The run waited for its slowest flagged rank of each window (not their sum), outside lost work."""
    worst: dict[int | None, Event] = {}
    for s in (e for e in events if e.kind == "straggler"):
        where = f" ({s.detail})" if s.detail else ""
        report.stragglers.append(f"rank {s.rank}{where}: the run waited {s.excess_s or 0:.1f} s for it by step {s.step}")
        if not any(a < s.t <= b for a, b in lost) and (s.step not in worst or
                                                       (s.excess_s or 0) > (worst[s.step].excess_s or 0)):
            worst[s.step] = s
    return sum(s.excess_s or 0.0 for s in worst.values())


def report_run(events: list[Event], hourly_override: float | None = None) -> RunReport:
    """One run's report from its events (all of one run, any order)."""
    events = sorted(events, key=lambda e: e.t)
    firsts = [e for e in events if e.kind == "first_step"]
    requested = [e.t for e in events if e.kind in ("capacity_requested", "node_booted")]
    start = min(requested) if requested else events[0].t
    finished = [e.t for e in events if e.kind == "run_finished"]
    end = max(finished) if finished else events[-1].t
    first = firsts[0].t if firsts else end
    prices = {e.node: e.node_hourly_usd or 0.0 for e in events if e.kind == "node_booted" and e.t <= first}
    team = next((e.team for e in events if e.team), "")
    hourly = hourly_override if hourly_override is not None else sum(prices.values())
    report = RunReport(events[0].run, team, len(prices), hourly, finished=bool(finished))
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds.update(_start_segments(events, start, first))
    seconds["straggler"] = _stragglers(report, events, _attempts(report, events, seconds, end))
    total = max(end - start, 1e-9)
    productive = max(0.0, total - sum(seconds.values()))
    report.total_hours, report.productive_hours = total / 3600, productive / 3600
    report.ettr = productive / total
    report.badput_hours = {k: v / 3600 for k, v in seconds.items()}
    report.badput_usd = {k: v / 3600 * hourly for k, v in seconds.items()}
    report.measured["wall_s"] = total
    return report


def report_all(events: list[Event], hourly_override: float | None = None) -> dict[str, object]:
    """Per run and per team (sums of hours and dollars; the team's ETTR over all its runs' time)."""
    by_run: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_run[e.run].append(e)
    runs = {name: report_run(evs, hourly_override) for name, evs in sorted(by_run.items())}
    teams: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in runs.values():
        team = teams[r.team or "(no team)"]
        team["runs"] += 1
        team["total_hours"] += r.total_hours
        team["productive_hours"] += r.productive_hours
        team["total_usd"] += r.total_hours * r.hourly_usd
        team["badput_usd"] += sum(r.badput_usd.values())
    for team in teams.values():
        team["ettr"] = team["productive_hours"] / team["total_hours"] if team["total_hours"] else 0.0
    return {"runs": {k: asdict(v) for k, v in runs.items()}, "teams": {k: dict(v) for k, v in teams.items()}}


def measure(events: list[Event]) -> dict[str, float]:
    """What the Daly interval needs, measured over the records' runs: the mean checkpoint blocked
    time δ, the mean wall time between failures M (inf: none) and the mean restart R."""
    if not events:
        raise ValueError("no events in the records")
    by_run: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_run[e.run].append(e)
    runs = [report_run(evs).measured for evs in by_run.values()]
    failures = sum(r["failures"] for r in runs)
    blocked = [e.blocked_s or 0.0 for e in events if e.kind == "checkpoint"]
    restarts = [r["restart_cost_s"] for r in runs if r["failures"]]
    if not blocked:
        raise ValueError("no checkpoint recorded: give --checkpoint-cost")
    return {"runs": float(len(runs)), "failures": failures, "wall_s": sum(r["wall_s"] for r in runs),
            "checkpoint_cost_s": statistics.mean(blocked),
            "mtbf_s": sum(r["wall_s"] for r in runs) / failures if failures else float("inf"),
            "restart_cost_s": statistics.mean(restarts) if restarts else 0.0}


def render(found: dict[str, object]) -> str:
    lines: list[str] = []
    runs = found["runs"]
    assert isinstance(runs, dict)
    for name, r in runs.items():
        lines.append(f"run {name} (team {r['team'] or '-'}, {r['nodes']} nodes at {r['hourly_usd']:.2f} USD/h"
                     f"{'' if r['finished'] else ', not finished'}): ETTR {r['ettr']:.1%} of "
                     f"{r['total_hours']:.2f} h ({r['total_hours'] * r['hourly_usd']:.2f} USD)")
        for cat in CATEGORIES:
            hours = r["badput_hours"][cat]
            lines.append(f"  {cat:22} {hours:9.3f} h {hours * 3600:9.0f} s {r['badput_usd'][cat]:10.2f} USD")
        lines += [f"  - {x}" for x in r["failures"] + r["hangs"] + r["stragglers"]]
    teams = found["teams"]
    assert isinstance(teams, dict)
    for team, t in teams.items():
        lines.append(f"team {team}: {t['runs']:.0f} run(s), ETTR {t['ettr']:.1%} of {t['total_hours']:.2f} h, "
                     f"badput {t['badput_usd']:.2f} of {t['total_usd']:.2f} USD")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`python -m training.goodput report --records URL`: exit 2 with one line on bad records."""
    import argparse
    import json
    import sys

    from training import records

    parser = argparse.ArgumentParser(prog="python -m training.goodput report", allow_abbrev=False,
                                     description="ETTR and badput of each run (and team) from its records")
    parser.add_argument("--records", required=True, help="the run's CHECKPOINT_URL (its records/ folder)")
    parser.add_argument("--hourly-usd", type=float, help="the run's price per hour (default: its nodes' records)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    if not args.records.strip():
        print("error: --records is empty: give the run's CHECKPOINT_URL (make goodput RECORDS=<url>)", file=sys.stderr)
        return 2
    if args.hourly_usd is not None and not args.hourly_usd >= 0:
        print(f"error: --hourly-usd {args.hourly_usd}: must not be negative", file=sys.stderr)
        return 2
    try:
        events = records.read(args.records)
    except (records.BadRecords, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not events:
        print(f"error: {args.records}: no events in its records/ folder", file=sys.stderr)
        return 2
    found = report_all(events, args.hourly_usd)
    print(json.dumps(found, indent=2) if args.format == "json" else render(found))
    return 0
