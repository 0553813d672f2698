"""Monitoring for a stack: Prometheus alerting rules and a Grafana dashboard, generated from
the stack spec.

Both read what the nodes export — the trainer (`gts_*`, training/trainer/metrics.py), the spot watcher
(`gts_spot_interruption_notice`, through the node exporter) and the DCGM exporter — so they work
the same on every cloud. The rules cover spending pace against the budget, idle GPUs, and work
at risk (stale checkpoints, uploads stuck, spot reclaims); on Alibaba Cloud, whose provider has
no budget resource, the budget-pace alert is the stack's running budget check. The dashboard
shows spend against the budget, throughput, loss, checkpoint health and the GPUs.
`make monitoring STACK=<name> OUT=<dir>` writes `alerts-<stack>.yml` (load with `rule_files:`)
and `dashboard-<stack>.json` (import into Grafana, pick the Prometheus data source).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from infra.core import catalog as cat
from infra.model.spec import StackSpec
from infra.resolve.resolved import Stack

GPU_IDLE_PERCENT = 5  # below this average utilisation for GPU_IDLE_FOR, a GPU is paid for nothing
GPU_IDLE_FOR = "30m"
CHECKPOINT_STALE_FACTOR = 3  # intervals of `training.checkpointEvery` steps without a commit
CHECKPOINT_STALE_MIN_S = 600  # never alert on a stale checkpoint younger than this
UPLOADS_PENDING_FOR = "15m"
# USD a month at the current pace: what the running nodes report (gts_node_hourly_usd) x hours.
SPEND_PACE = f"sum(gts_node_hourly_usd) * {cat.HOURS_PER_MONTH:g}"


def _rule(alert: str, expr: str, for_: str, severity: str, env: str, summary: str,
          extra: dict[str, str] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": alert, "expr": expr}
    if for_ != "0s":
        rule["for"] = for_
    rule["labels"] = {"severity": severity, "env": env, **(extra or {})}
    rule["annotations"] = {"summary": summary}
    return rule


def rules(spec: StackSpec, stack: Stack | None = None) -> dict[str, Any]:
    """The rules file (Prometheus `groups:` format) for this stack (`stack`: its groups already
    resolved, as the program holds them; resolved here where needed otherwise)."""
    env, budget = spec.env, spec.budget
    cost = [
        _rule("GtsBudgetPace", f"{SPEND_PACE} > {budget.monthly_limit_usd * pct / 100:g}", "30m",
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
    every = spec.training.checkpoint_every
    # auto: the interval the trainer chose (it exports it); otherwise the fixed one
    interval = "gts_checkpoint_interval_steps" if every == "auto" else str(every)
    stale_after = (f"clamp_min({CHECKPOINT_STALE_FACTOR} * {interval} * gts_train_step_seconds, "
                   f"{CHECKPOINT_STALE_MIN_S})")
    work = [
        _rule("GtsCheckpointStale", f"time() - gts_checkpoint_last_commit_timestamp_seconds > {stale_after}", "5m",
              "warning", env,
              f"no checkpoint committed on node {{{{ $labels.node }}}} for {CHECKPOINT_STALE_FACTOR} "
              + ("of the intervals it chose (checkpointEvery: auto)" if every == "auto" else f"intervals of {every} steps")
              + ": a reclaim now loses that work"),
        _rule("GtsCheckpointUploadsPending", "gts_checkpoint_uploads_pending > 0", UPLOADS_PENDING_FOR, "warning",
              env, "{{ $value }} committed checkpoint(s) on node {{ $labels.node }} are not in the bucket yet: "
                   "the object store is unreachable or refusing writes; they stay on local disk and are retried"),
        _rule("GtsSpotInterruption", "gts_spot_interruption_notice == 1", "0s", "info", env,
              "the cloud is reclaiming spot node {{ $labels.instance }}: the trainer was sent SIGTERM and saves "
              "an emergency checkpoint"),
    ]
    return {"groups": [{"name": f"gts-{env}-cost", "rules": cost},
                       {"name": f"gts-{env}-goodput", "rules": goodput_rules()},
                       {"name": f"gts-{env}-work-at-risk", "rules": work},
                       {"name": f"gts-{env}-gpu-health", "rules": gpu_health_rules(env)},
                       {"name": f"gts-{env}-showback", "rules": showback(spec, stack)}]}


GPU_REPLACEMENTS_PER_DAY = 2  # more nodes of one group replaced for GPU faults in a day: a bad batch or zone


def gpu_health_rules(env: str) -> list[dict[str, Any]]:
    """From the node's GPU gate and Xid watch (cloudinit/scripts/gts-gpu-health.py, through the node
    exporter's textfile directory) and the DCGM exporter's counters (cloudinit/dcgm-counters.csv)."""
    return [
        _rule("GtsGpuGateFailed", "gts_gpu_gate_ok == 0", "0s", "warning", env,
              "node {{ $labels.instance }} of {{ $labels.group }} failed its GPU boot gate: its trainer did not "
              "start and it asked its group for a replacement"),
        _rule("GtsGpuXidReplace", 'increase(gts_gpu_xid_events_total{action="replace"}[10m]) > 0', "0s", "critical", env,
              "Xid {{ $labels.xid }} on node {{ $labels.instance }} of {{ $labels.group }}: checkpointing and "
              "replacing the node"),
        _rule("GtsGpuReplacedOften",
              f"count by (group) (max_over_time(gts_gpu_replace_requested[1d])) > {GPU_REPLACEMENTS_PER_DAY}", "0s",
              "critical", env,
              f"{{{{ $value }}}} nodes of {{{{ $labels.group }}}} asked to be replaced for GPU faults in a day "
              f"(over {GPU_REPLACEMENTS_PER_DAY}): a bad batch of hosts or a zone; look before the group burns more"),
        _rule("GtsGpuDoubleBitEcc", "increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[10m]) > 0", "0s", "warning", env,
              "double-bit ECC errors on GPU {{ $labels.gpu }} of {{ $labels.instance }}"),
    ]


RUN_ETTR = "gts:run_ettr"
TEAM_ETTR = "gts:team_ettr"
# One value per run (its nodes' trainers all export it): the largest, by run and team.
_KEPT = "max by (run, team) (gts_run_productive_seconds)"
_WALL = "max by (run, team) (time() - gts_run_started_timestamp_seconds)"


def goodput_rules() -> list[dict[str, Any]]:
    """ETTR live, per run and per team: the training time a run keeps (its newest committed step
    at the median step time, training/trainer/progress.py) over its wall time since it first
    asked for capacity (its records). `make goodput` gives the full breakdown from the records."""
    # clamped to 1: the productive estimate (newest step x median step time) can run ahead of the wall
    return [{"record": RUN_ETTR, "expr": f"clamp_max({_KEPT} / {_WALL}, 1)"},
            {"record": TEAM_ETTR, "expr": f"clamp_max(sum by (team) ({_KEPT}) / sum by (team) ({_WALL}), 1)"}]


TEAM_NODE_SPEND = "gts:team_node_spend_usd_per_month"
TEAM_QUEUE_SPEND = "gts:team_queue_spend_usd_per_month"
QUEUE_GPU_SPEND = "gts:queue_gpu_spend_usd_per_hour"


def showback(spec: StackSpec, stack: Stack | None = None) -> list[dict[str, Any]]:
    """Spend per team: what the running nodes report, by the team label every trainer exports
    (GTS_TEAM); and on shared clusters (kubernetes.queues) the GPUs Kueue has admitted for each
    team's ClusterQueue (team-<name>), priced per flavor at its GPU-hour."""
    out: list[dict[str, Any]] = [{"record": TEAM_NODE_SPEND,
                                  "expr": f"sum by (team) (gts_node_hourly_usd) * {cat.HOURS_PER_MONTH:g}"}]
    if not spec.kubernetes.queues:
        return out
    from infra.resolve.groups import resolve
    from infra.teams.queues import flavors

    stack = stack or resolve(spec)
    for cloud in spec.clouds:
        for name, flavor in sorted(flavors(stack, cloud).items()):
            usage = ('kueue_cluster_queue_resource_usage{resource="nvidia.com/gpu",'
                     f'flavor="{name}",replica_role="leader"}}')
            out.append({"record": QUEUE_GPU_SPEND,
                        "expr": f"sum by (cluster_queue, flavor) ({usage}) * {flavor.gpu_hourly_usd:g}"})
    out.append({"record": TEAM_QUEUE_SPEND,
                "expr": f'sum by (team) (label_replace({QUEUE_GPU_SPEND}, "team", "$1", "cluster_queue", "team-(.+)"))'
                        f" * {cat.HOURS_PER_MONTH:g}"})
    return out


def render(spec: StackSpec, stack: Stack | None = None) -> str:
    header = (f"# Prometheus alerting rules for the {spec.env} stack, written by `make monitoring` "
              "(infra/monitoring.py). Load with rule_files.\n")
    return header + yaml.safe_dump(rules(spec, stack), sort_keys=False, width=120)


# Dashboard panels: (title, unit, [(PromQL, legend)]). Grafana's own unit ids.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Spending pace of running GPU nodes (USD a month)", "currencyUSD",
     [(SPEND_PACE, "all nodes"),
      (f"sum by (cloud) (gts_node_hourly_usd) * {cat.HOURS_PER_MONTH:g}", "{{cloud}}")]),
    ("Spending pace by team (USD a month)", "currencyUSD",
     [(TEAM_NODE_SPEND, "{{team}} nodes"), (TEAM_QUEUE_SPEND, "{{team}} queued on shared clusters")]),
    ("Effective training time ratio (ETTR) by run and team", "percentunit",
     [(RUN_ETTR, "run {{run}} ({{team}})"), (TEAM_ETTR, "team {{team}}")]),
    ("Running nodes by group", "short", [("count by (cloud, group) (gts_node_hourly_usd)", "{{cloud}}/{{group}}")]),
    ("Cost since start by group (USD)", "currencyUSD",
     [("sum by (cloud, group) (gts_node_cost_usd)", "{{cloud}}/{{group}}")]),
    ("Throughput (samples/s)", "short",
     [("sum by (group) (gts_train_samples_per_second)", "{{group}}")]),
    ("Loss", "short", [("avg by (group) (gts_train_loss)", "{{group}}")]),
    ("Step time", "s", [("max by (group) (gts_train_step_seconds)", "{{group}}")]),
    ("Checkpoint age", "s",
     [("max by (group, node) (time() - gts_checkpoint_last_commit_timestamp_seconds)", "{{group}} node {{node}}")]),
    ("Loop blocked by the last checkpoint", "s",
     [("max by (group) (gts_checkpoint_seconds)", "{{group}}")]),
    ("Checkpoints waiting for the bucket", "short",
     [("sum by (group) (gts_checkpoint_uploads_pending)", "{{group}}")]),
    ("GPU utilisation", "percent", [("avg by (instance) (DCGM_FI_DEV_GPU_UTIL)", "{{instance}}")]),
    ("GPU memory used", "decmbytes", [("sum by (instance) (DCGM_FI_DEV_FB_USED)", "{{instance}}")]),
    ("Spot reclaim notices", "short", [("sum by (cloud) (gts_spot_interruption_notice)", "{{cloud}}")]),
    ("GPU health: gate failures, Xid events, replacements", "short",
     [("count by (group) (gts_gpu_gate_ok == 0)", "{{group}} gate failed"),
      ("sum by (group, xid, action) (increase(gts_gpu_xid_events_total[1h]))", "{{group}} Xid {{xid}} ({{action}})"),
      ("count by (group) (max_over_time(gts_gpu_replace_requested[1d]))", "{{group}} replaced (1 d)"),
      ("sum by (instance) (increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[1h]))", "{{instance}} DBE ECC")]),
]


def dashboard(spec: StackSpec) -> dict[str, Any]:
    """A Grafana dashboard (JSON model) over the Prometheus that scrapes the stack's nodes."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        defaults: dict[str, Any] = {"unit": unit}
        if i == 0:  # the budget as a red line on the spending pace
            defaults["thresholds"] = {"mode": "absolute", "steps": [
                {"color": "green", "value": None},
                {"color": "red", "value": spec.budget.monthly_limit_usd}]}
            defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": datasource,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "targets": [{"refId": chr(ord("A") + k), "datasource": datasource, "expr": expr, "legendFormat": legend}
                        for k, (expr, legend) in enumerate(targets)],
        })
    return {
        "title": f"GPU training — {spec.env}",
        "uid": f"gts-{spec.env}"[:40],
        "tags": ["gpu-training-stack", spec.env],
        "timezone": "utc",
        "schemaVersion": 39,
        "refresh": "1m",
        "time": {"from": "now-24h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render_dashboard(spec: StackSpec) -> str:
    return json.dumps(dashboard(spec), indent=2, ensure_ascii=False) + "\n"


def write_all(spec: StackSpec, stack: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {out / f"alerts-{stack}.yml": render(spec), out / f"dashboard-{stack}.json": render_dashboard(spec)}
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)
