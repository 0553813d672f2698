"""Goodput under preemption: how often to checkpoint, and what share of the paid time becomes
training progress.

The interval is Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", Future Generation Computer Systems 22 (2006) 303-312) for
checkpoint cost δ (the seconds the loop is blocked per checkpoint) and mean time between
failures M:

    τ = sqrt(2δM) · [1 + (1/3)·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ      for δ < 2M
    τ = M                                                          for δ ≥ 2M

(Young's first-order sqrt(2δM) is its leading term.) Daly's wall-clock model for a run of T
seconds of work with restart cost R gives the expected goodput

    G(τ) = τ / (M · e^{R/M} · (e^{(τ+δ)/M} − 1)).

A reclaim notice changes M: a reclaim announced at least as long before it happens as a
checkpoint takes to become durable loses no work (the emergency checkpoint saves it), so the
interval only has to cover the failures that come without a usable notice. Of the rate 1/M,
`unannounced` is the share that does (hardware faults, a notice shorter than a durable save); the
rest costs the notice itself (the trainer saves when the notice comes and stops: what the node
could still compute until the reclaim is not kept) and a restart each.

    python -m training.goodput --checkpoint-cost 20 --mtbf 3600 [--restart-cost 60] [--notice 120]
    python -m training.goodput ... --simulate poisson:3600:7        # or weibull:0.7:3600:7, or a file
    python -m training.goodput report --records s3://bucket/run/     # a run's ETTR (training/goodput_report.py)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

# Failures that come without a usable notice when the cloud gives one (hardware, host
# maintenance, a lost notice): an estimate, overridable with --unannounced.
UNANNOUNCED_SHARE = 0.05
HORIZON_FAILURES = 2000  # generated traces: enough reclaims that the mean is stable


def daly_interval(delta: float, mtbf: float) -> float:
    """Seconds of training between checkpoints (not counting the checkpoint itself)."""
    if delta <= 0 or mtbf <= 0:
        raise ValueError("checkpoint cost and MTBF must be positive")
    if delta >= 2 * mtbf:
        return mtbf
    ratio = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


def young_interval(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly_goodput(interval: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    """Expected share of wall time that is progress, failures exponential with mean `mtbf`."""
    if math.isinf(mtbf):
        return interval / (interval + delta)
    return interval / (mtbf * math.exp(restart / mtbf) * math.expm1((interval + delta) / mtbf))


def lost_per_failure(interval: float, delta: float, mtbf: float) -> float:
    """Expected seconds of work lost at an unannounced failure (the part of the current cycle
    already done, for exponential failures)."""
    if math.isinf(mtbf):
        return 0.0
    cycle = interval + delta
    return mtbf - cycle / math.expm1(cycle / mtbf)


@dataclass(frozen=True)
class Plan:
    """The interval for one situation, and what it yields."""

    interval_s: float
    goodput: float
    lost_work_per_reclaim_s: float
    unannounced_mtbf_s: float
    why: str


def plan(delta: float, mtbf: float, restart: float = 0.0, notice: float = 0.0, durable: float | None = None,
         unannounced: float | None = None) -> Plan:
    """The checkpoint interval and expected goodput for checkpoint cost `delta` (s), reclaims
    every `mtbf` s on average, restart cost `restart` (s), a reclaim notice of `notice` s, and a
    checkpoint that is durable `durable` s after it starts (default: `delta`)."""
    durable = delta if durable is None else durable
    covered = notice > 0 and notice >= durable
    share = (UNANNOUNCED_SHARE if unannounced is None else unannounced) if covered else 1.0
    m_unannounced = mtbf / share if share > 0 else math.inf
    interval = daly_interval(delta, m_unannounced) if share > 0 else math.inf
    announced_rate = (1 - share) / mtbf if covered else 0.0
    kept = max(0.0, 1 - announced_rate * (notice + restart))  # each announced reclaim: the notice and a restart
    # An unannounced failure takes the node's disk: a checkpoint still uploading (the `lag`
    # after it is committed) is lost with it, and the interval before it.
    lag = max(0.0, durable - delta)
    if math.isinf(interval):
        goodput, lost = kept, 0.0
    else:
        extra = lag * interval / (interval + delta) if lag < interval + delta else interval
        goodput = daly_goodput(interval, delta, m_unannounced, restart) * kept * max(0.0, 1 - extra / m_unannounced)
        lost = share * (lost_per_failure(interval, delta, m_unannounced) + extra)
    if covered:
        why = (f"a {notice:.0f} s notice covers a durable checkpoint ({durable:.1f} s): only the {share:.0%} of "
               f"reclaims without one need the interval (their MTBF {m_unannounced:.0f} s)")
    elif notice > 0:
        why = f"the {notice:.0f} s notice is shorter than a durable checkpoint ({durable:.1f} s): no help"
    else:
        why = "no reclaim notice: every reclaim loses the work since the last checkpoint"
    return Plan(interval, goodput, lost, m_unannounced, f"Daly (FGCS 2006) with δ={delta:.2f} s, M={mtbf:.0f} s; {why}")


class AutoInterval:
    """`checkpointEvery: auto` in a training loop: Daly's interval converted to steps with the
    measured step time, re-planned each time a checkpoint's loop-blocked time δ is measured.
    Until the first checkpoint (taken within a minute, to measure it), δ is taken as 1 s."""

    DEFAULT_MTBF_S = 6 * 3600.0  # no figure from the stack: six hours between interruptions
    FIRST_DELTA_S = 1.0
    FIRST_CHECKPOINT_S = 60.0

    def __init__(self, mtbf_s: float, notice_s: float, log: Callable[[str], None]):
        self.mtbf = mtbf_s if mtbf_s > 0 else self.DEFAULT_MTBF_S
        self.source = "from the stack" if mtbf_s > 0 else "assumed (MTBF_S not set)"
        self.notice = notice_s
        self.log = log
        self.delta: float | None = None
        self.durable: float | None = None  # from the start of a checkpoint until it is in the bucket
        self.step_s: float | None = None
        self.steps: int | None = None

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.9 * self.step_s + 0.1 * seconds

    def observe_checkpoint(self, blocked_s: float) -> None:
        self.delta = blocked_s if self.delta is None else 0.5 * self.delta + 0.5 * blocked_s
        self._replan()

    def observe_durable(self, seconds: float) -> None:
        """A notice shorter than this does not save the work in flight."""
        self.durable = seconds if self.durable is None else max(0.5 * self.durable + 0.5 * seconds, seconds)
        self._replan()

    def _replan(self) -> None:
        if self.step_s is None:
            return
        delta = max(self.delta or self.FIRST_DELTA_S, 1e-3)
        found = plan(delta, self.mtbf, notice=self.notice, durable=max(self.durable or 0.0, delta))
        steps = 10**9 if math.isinf(found.interval_s) else max(1, round(found.interval_s / max(self.step_s, 1e-6)))
        first = ""
        if self.delta is None and steps * self.step_s > self.FIRST_CHECKPOINT_S:
            steps, first = max(1, round(self.FIRST_CHECKPOINT_S / max(self.step_s, 1e-6))), "; the first one early, to measure δ"
        if self.steps is None or abs(steps - self.steps) > 0.1 * self.steps:
            interval = "never" if math.isinf(found.interval_s) else f"~{found.interval_s:.{0 if found.interval_s >= 10 else 1}f} s"
            self.log(f"checkpoint interval: every {steps} steps ({interval} at {self.step_s:.3f} s/step; "
                     f"expected goodput {found.goodput:.1%}): {found.why}; M {self.source}{first}")
        self.steps = steps

    def due(self, steps_since_save: int) -> bool:
        if self.steps is None:
            self._replan()
        return self.steps is not None and steps_since_save >= self.steps


# ------------------------------------------------------------------ simulation

def trace_times(spec: str) -> list[float]:
    """Reclaim times in seconds from the start: a file (one number of seconds or one ISO 8601
    time per line; '#' lines are comments), or `poisson:MTBF[:SEED[:COUNT]]`, or `weibull:SHAPE:SCALE[:SEED[:COUNT]]`."""
    kind, _, rest = spec.partition(":")
    if kind in ("poisson", "weibull"):
        parts = [float(p) for p in rest.split(":") if p]
        need = 1 if kind == "poisson" else 2
        if len(parts) < need:
            raise ValueError(f"{spec!r}: {kind} needs {'MTBF' if need == 1 else 'SHAPE:SCALE'} in seconds")
        if not all(math.isfinite(p) and p > 0 for p in parts[:need]):
            raise ValueError(f"{spec!r}: {'MTBF must be a positive number' if need == 1 else 'SHAPE and SCALE must be positive numbers'}")
        seed = int(parts[need]) if len(parts) > need else 0
        count = int(parts[need + 1]) if len(parts) > need + 1 else HORIZON_FAILURES
        if count < 1:
            raise ValueError(f"{spec!r}: the trace needs at least one reclaim")
        rng = random.Random(seed)
        times, t = [], 0.0
        for _ in range(count):
            t += rng.expovariate(1 / parts[0]) if kind == "poisson" else rng.weibullvariate(parts[1], parts[0])
            times.append(t)
        return times
    lines = [line.strip() for line in Path(spec).read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]  # '#': a comment (where the trace came from)
    try:
        values = [float(line) for line in lines]
    except ValueError:
        stamps = [datetime.fromisoformat(line.replace("Z", "+00:00")).timestamp() for line in lines]
        values = [s - min(stamps) for s in stamps]
    if not values:
        raise ValueError(f"{spec}: no reclaim times in it (one per line: seconds, or an ISO 8601 time)")
    if not all(math.isfinite(v) and v >= 0 for v in values) or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{spec}: reclaim times must be finite, not negative, and in order, one per line")
    if values[-1] <= 0:
        raise ValueError(f"{spec}: the last reclaim must come after the start")
    return values


def simulate(times: list[float], interval: float, delta: float, restart: float = 0.0, notice: float = 0.0,
             durable: float | None = None, unannounced: float = UNANNOUNCED_SHARE, seed: int = 0) -> float:
    """Goodput over a reclaim trace: cycles of `interval` s of work and a `delta` s checkpoint;
    at each reclaim the work since the last checkpoint is lost, unless the reclaim is announced
    (a share 1 - `unannounced`, drawn with `seed`) by a notice long enough for a durable save;
    then `restart` s pass before work resumes."""
    durable = delta if durable is None else durable
    covered = notice > 0 and notice >= durable
    lag = max(0.0, durable - delta)  # a committed checkpoint is in the bucket this much later
    rng = random.Random(seed)
    work, start = 0.0, 0.0
    for t in times:
        gap = t - start
        cycle = interval + delta
        full = math.floor(gap / cycle) if not math.isinf(interval) else 0
        work += full * interval
        left = gap - full * cycle
        if covered and rng.random() >= unannounced:
            # the emergency checkpoint starts with the notice: the work until then is kept
            work += max(0.0, min(left - notice, interval))
        elif full and left < lag:
            # the node and its disk are gone: checkpoints not yet uploaded are lost too
            work -= min(full, math.floor((lag - left) / cycle) + 1) * interval
        start = t + restart
    return work / times[-1] if times and times[-1] > 0 else 0.0


def sweep(times: list[float], delta: float, restart: float, notice: float, fixed: list[float],
          durable: float | None = None, unannounced: float = UNANNOUNCED_SHARE) -> dict[str, float]:
    """Goodput of `auto` (Daly with M from the trace) and of each fixed interval, on one trace."""
    mtbf = times[-1] / len(times)
    auto = plan(delta, mtbf, restart, notice, durable, unannounced).interval_s
    out = {"auto": simulate(times, auto, delta, restart, notice, durable, unannounced)}
    for value in fixed:
        out[f"{value:g} s"] = simulate(times, value, delta, restart, notice, durable, unannounced)
    return out


# ------------------------------------------------------------------ command line

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.goodput", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--checkpoint-cost", type=float, help="δ: seconds the loop is blocked (default: --records')")
    parser.add_argument("--mtbf", type=float, help="M: mean seconds between reclaims (default: --records')")
    parser.add_argument("--restart-cost", type=float, help="R: seconds from a reclaim to training (default 0, or "
                                                           "--records')")
    parser.add_argument("--records", metavar="URL", help="a run's CHECKPOINT_URL: δ, M and R measured from its records "
                                                         "(training/records.py) instead of the market's rates")
    parser.add_argument("--notice", type=float, default=0.0, help="seconds of reclaim notice (AWS, Tencent: 120)")
    parser.add_argument("--durable", type=float, default=None, help="seconds until a checkpoint is in the bucket")
    parser.add_argument("--unannounced", type=float, default=UNANNOUNCED_SHARE,
                        help="share of reclaims without a usable notice when there is one")
    parser.add_argument("--simulate", metavar="TRACE", help="a file of reclaim times, poisson:MTBF[:SEED], "
                                                            "or weibull:SHAPE:SCALE[:SEED]")
    parser.add_argument("--fixed", default="60,300,600,1800,3600", help="fixed intervals (s) to compare")
    parser.add_argument("--peer", metavar="STEPS:STEP_S:COST_S:RESTART_S",
                        help="with --simulate, also the in-memory peer tier: a copy every STEPS steps of STEP_S s "
                             "costing COST_S s, a restart from it in RESTART_S s (lost work <= STEPS steps)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    return parser


def _measured(args: argparse.Namespace) -> list[str]:
    """Fill δ, M and R from the run's records where the flags leave them; the problems found."""
    if not args.records:
        args.restart_cost = args.restart_cost or 0.0
        return [f"--{n} is required (or --records URL, to measure it)" for n, v in
                (("checkpoint-cost", args.checkpoint_cost), ("mtbf", args.mtbf)) if v is None]
    from training import goodput_report, records

    try:
        found = goodput_report.measure(records.read(args.records))
    except (records.BadRecords, ValueError, OSError) as exc:
        return [f"--records {args.records}: {exc}"]
    args.measured = found
    for flag, key in (("checkpoint_cost", "checkpoint_cost_s"), ("mtbf", "mtbf_s"), ("restart_cost", "restart_cost_s")):
        if getattr(args, flag) is None:
            setattr(args, flag, found[key])
    return [] if args.mtbf != math.inf else [f"--records {args.records}: no failure recorded: give --mtbf"]


def _problems(args: argparse.Namespace) -> tuple[list[str], list[float], list[float]]:
    problems = _measured(args)
    if problems:
        return problems, [], []
    problems = [f"--{name.replace('_', '-')} {value}: {rule}" for name, value, ok, rule in (
        ("checkpoint_cost", args.checkpoint_cost, args.checkpoint_cost > 0, "must be above 0"),
        ("mtbf", args.mtbf, args.mtbf > 0, "must be above 0"),
        ("restart_cost", args.restart_cost, args.restart_cost >= 0, "must not be negative"),
        ("notice", args.notice, args.notice >= 0, "must not be negative"),
        ("durable", args.durable, args.durable is None or args.durable >= 0, "must not be negative"),
        ("unannounced", args.unannounced, 0 <= args.unannounced <= 1, "is a share between 0 and 1"))
        if not ok or (isinstance(value, float) and not math.isfinite(value))]
    try:
        fixed_values = [float(x) for x in args.fixed.split(",") if x]
    except ValueError:
        fixed_values, problems = [], [*problems, f"--fixed {args.fixed}: comma-separated seconds"]
    problems += [f"--fixed {v:g}: intervals must be above 0" for v in fixed_values if not v > 0]
    peer: list[float] = []
    if args.peer:
        try:
            peer = [float(x) for x in args.peer.split(":")]
        except ValueError:
            peer = []
        if len(peer) != 4 or not all(math.isfinite(v) and v >= 0 for v in peer) or not peer[0] * peer[1] > 0:
            problems.append(f"--peer {args.peer}: STEPS:STEP_S:COST_S:RESTART_S, e.g. 50:1.0:0.5:30")
    return problems, fixed_values, peer


def _simulation(args: argparse.Namespace, fixed: list[float], peer: list[float]) -> dict[str, object]:
    times = trace_times(args.simulate)
    out: dict[str, object] = {
        "reclaims": len(times), "trace_mtbf_s": times[-1] / len(times),
        "with_notice": sweep(times, args.checkpoint_cost, args.restart_cost, args.notice or 120, fixed,
                             args.durable, args.unannounced),
        "without_notice": sweep(times, args.checkpoint_cost, args.restart_cost, 0.0, fixed, args.durable)}
    if peer:
        steps, step_s, cost, restart = peer
        interval = steps * step_s
        out["peer_tier"] = {
            "assumptions": f"a copy in a peer's memory every {steps:g} steps of {step_s:g} s ({interval:g} s) "
                           f"blocking {cost:g} s; after a reclaim the run restarts from it in {restart:g} s and loses "
                           f"at most {steps:g} steps; {args.unannounced:.0%} of reclaims come without a usable notice",
            "with_notice": simulate(times, interval, cost, restart, args.notice or 120, cost, args.unannounced),
            "without_notice": simulate(times, interval, cost, restart, 0.0, cost)}
    return out


def _print_text(result: Plan, report: dict[str, object]) -> None:
    interval = "never (every reclaim is announced in time)" if math.isinf(result.interval_s) else \
        f"{result.interval_s:.0f} s"
    if "measured" in report:
        print("from the run's records: " + ", ".join(f"{k} {v:.1f}" for k, v in report["measured"].items()))  # type: ignore[attr-defined]
    print(f"interval_s        {interval}\ngoodput           {result.goodput:.2%}\n"
          f"lost per reclaim  {result.lost_work_per_reclaim_s:.0f} s of work\nwhy               {result.why}")
    sim = report.get("simulation")
    if isinstance(sim, dict):
        print(f"\nsimulated over {sim['reclaims']} reclaims (trace MTBF {sim['trace_mtbf_s']:.0f} s):")
        for label in ("with_notice", "without_notice"):
            rows = sim[label]
            print(f"  {label.replace('_', ' '):15} " + "  ".join(f"{k}: {v:.2%}" for k, v in rows.items()))
        if "peer_tier" in sim:
            tier = sim["peer_tier"]
            print(f"  peer tier       with notice: {tier['with_notice']:.2%}  without notice: "
                  f"{tier['without_notice']:.2%}\n  assumptions: {tier['assumptions']}")


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["report"]:  # a run's ETTR from its records (training/goodput_report.py)
        from training import goodput_report

        return goodput_report.main(args_in[1:])
    args = _parser().parse_args(args_in)
    problems, fixed, peer = _problems(args)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    try:
        result = plan(args.checkpoint_cost, args.mtbf, args.restart_cost, args.notice, args.durable, args.unannounced)
        report: dict[str, object] = {**asdict(result)}
        if args.records:
            report["measured"] = args.measured
        if args.simulate:
            report["simulation"] = _simulation(args, fixed, peer)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(report, indent=2, default=lambda v: None if isinstance(v, float) and math.isinf(v) else v))
    else:
        _print_text(result, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
