"""Prometheus alerting rules for a stack: spend pace against the budget, idle GPUs, and work at
risk (stale checkpoints, uploads stuck, spot reclaims).

They read what the nodes export — the trainer (`gts_*`, training/metrics.py), the spot watcher
(`gts_spot_interruption_notice`, through the node exporter) and the DCGM exporter — so they work
the same on every cloud. On Alibaba Cloud, whose provider has no budget resource, the budget
pace alert is the stack's own budget check. `make alerts STACK=<name> OUT=<file>` writes them;
load the file into the team's Prometheus (`rule_files:`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from infra import catalog as cat
from infra.spec import StackSpec

GPU_IDLE_PERCENT = 5  # below this average utilisation for GPU_IDLE_FOR, a GPU is paid for nothing
GPU_IDLE_FOR = "30m"
CHECKPOINT_STALE_FACTOR = 3  # intervals of `training.checkpointEvery` steps without a commit
CHECKPOINT_STALE_MIN_S = 600  # never alert on a stale checkpoint younger than this
UPLOADS_PENDING_FOR = "15m"


def _rule(alert: str, expr: str, for_: str, severity: str, env: str, summary: str,
          extra: dict[str, str] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": alert, "expr": expr}
    if for_ != "0s":
        rule["for"] = for_
    rule["labels"] = {"severity": severity, "env": env, **(extra or {})}
    rule["annotations"] = {"summary": summary}
    return rule


def rules(spec: StackSpec) -> dict[str, Any]:
    """The rules file (Prometheus `groups:` format) for this stack."""
    env, budget = spec.env, spec.budget
    monthly = f"sum(gts_node_hourly_usd) * {cat.HOURS_PER_MONTH:g}"
    cost = [
        _rule("GtsBudgetPace", f"{monthly} > {budget.monthly_limit_usd * pct / 100:g}", "30m",
              "critical" if pct >= 100 else "warning", env,
              f"GPU nodes running now cost {{{{ $value | humanize }}}} USD a month at this pace: over {pct}% "
              f"of the {env} budget ({budget.monthly_limit_usd:g} USD); scale node groups down or raise "
              "budget.monthlyLimitUsd", {"threshold_percent": str(pct)})
        for pct in sorted(budget.thresholds_percent)
    ]
    cost.append(_rule(
        "GtsGpuIdle", f"avg by (instance) (DCGM_FI_DEV_GPU_UTIL) < {GPU_IDLE_PERCENT}", GPU_IDLE_FOR, "warning", env,
        f"GPUs on {{{{ $labels.instance }}}} averaged under {GPU_IDLE_PERCENT}% for {GPU_IDLE_FOR}: a paid node "
        "doing no work; check the trainer or scale the group down"))
    stale_after = (f"clamp_min({CHECKPOINT_STALE_FACTOR} * {spec.training.checkpoint_every} * gts_train_step_seconds, "
                   f"{CHECKPOINT_STALE_MIN_S})")
    work = [
        _rule("GtsCheckpointStale", f"time() - gts_checkpoint_last_commit_timestamp_seconds > {stale_after}", "5m",
              "warning", env,
              f"no checkpoint committed on node {{{{ $labels.node }}}} for {CHECKPOINT_STALE_FACTOR} intervals of "
              f"{spec.training.checkpoint_every} steps: a reclaim now loses that work"),
        _rule("GtsCheckpointUploadsPending", "gts_checkpoint_uploads_pending > 0", UPLOADS_PENDING_FOR, "warning",
              env, "{{ $value }} committed checkpoint(s) on node {{ $labels.node }} are not in the bucket yet: "
                   "the object store is unreachable or refusing writes; they stay on local disk and are retried"),
        _rule("GtsSpotInterruption", "gts_spot_interruption_notice == 1", "0s", "info", env,
              "the cloud is reclaiming spot node {{ $labels.instance }}: the trainer was sent SIGTERM and saves "
              "an emergency checkpoint"),
    ]
    return {"groups": [{"name": f"gts-{env}-cost", "rules": cost},
                       {"name": f"gts-{env}-work-at-risk", "rules": work}]}


def render(spec: StackSpec) -> str:
    header = (f"# Prometheus alerting rules for the {spec.env} stack, written by `make alerts` "
              "(infra/alerts.py). Load with rule_files.\n")
    return header + yaml.safe_dump(rules(spec), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from infra.errors import SpecError
    from infra.plan.engine import StackFileError
    from infra.program import load_stack_spec

    parser = argparse.ArgumentParser(prog="make alerts", description="write the stack's Prometheus alerting rules")
    parser.add_argument("--stack", default="dev")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        text = render(load_stack_spec(args.stack))
    except (SpecError, StackFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
