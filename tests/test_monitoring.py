"""The stack's monitoring: Prometheus alerting rules checked and evaluated by Debian's promtool
(valid for every shipped stack; synthetic series make exactly the expected alerts fire) and the
Grafana dashboard's structure. tests/test_training.py runs both against a real Prometheus that
scrapes a real trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import monitoring
from infra.resolve.groups import resolve
from tests.harness import ROOT
from infra.stack.stackfile import load_stack_spec
from tests.system_tools import debian_tool


def promtool() -> str:
    return debian_tool("promtool", "prometheus")


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_rules_of_every_shipped_stack_pass_promtool(stack: str, tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(monitoring.render(load_stack_spec(stack)), encoding="utf-8")
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    budget = load_stack_spec(stack).budget
    pace = [r for g in monitoring.rules(load_stack_spec(stack))["groups"] for r in g["rules"]
            if r.get("alert") == "GtsBudgetPace"]
    assert [r["labels"]["threshold_percent"] for r in pace] == [str(p) for p in sorted(budget.thresholds_percent)]


def _alert(labels: dict[str, str], summary: str) -> dict[str, Any]:
    """An expected alert: promtool compares labels and the rendered annotations exactly."""
    return {"exp_labels": labels, "exp_annotations": {"summary": summary}}


def _synthetic_series() -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """promtool input series: two nodes' prices, one node's, and the work and GPU series."""
    node = 'node="0",workload="tiny",cloud="aws",group="aws-train"'
    two_nodes = [
        # 2 nodes x 3.06 USD/h x 730 h = 4467.6 USD a month: over 50, 80 and 100 % of 3000.
        {"series": f'gts_node_hourly_usd{{instance="a",{node}}}', "values": "3.06x60"},
        {"series": f'gts_node_hourly_usd{{instance="b",{node}}}', "values": "3.06x60"},
    ]
    one_node = [two_nodes[0]]  # 2233.8 USD: over 50 % (1500) only
    work = [
        # Node a last committed at t=0 with 0.5 s steps and the 200-step interval its trainer chose
        # (checkpointEvery: auto): stale after max(3 x 200 x 0.5, 600) s.
        {"series": f'gts_checkpoint_last_commit_timestamp_seconds{{instance="a",{node}}}', "values": "0x40"},
        {"series": f'gts_train_step_seconds{{instance="a",{node}}}', "values": "0.5x40"},
        {"series": f'gts_checkpoint_interval_steps{{instance="a",{node}}}', "values": "200x40"},
        {"series": f'gts_checkpoint_interval_steps{{instance="b",{node}}}', "values": "200x40"},
        # Node b commits every minute: never stale.
        {"series": f'gts_checkpoint_last_commit_timestamp_seconds{{instance="b",{node}}}', "values": "0+60x40"},
        {"series": f'gts_train_step_seconds{{instance="b",{node}}}', "values": "0.5x40"},
        {"series": f'gts_checkpoint_uploads_pending{{instance="a",{node}}}', "values": "2x40"},
        {"series": f'gts_checkpoint_uploads_pending{{instance="b",{node}}}', "values": "0x40"},
        {"series": 'gts_spot_interruption_notice{instance="c",cloud="alicloud"}', "values": "_x5 1x35"},
        {"series": 'DCGM_FI_DEV_GPU_UTIL{instance="a",gpu="0"}', "values": "2x40"},
        {"series": 'DCGM_FI_DEV_GPU_UTIL{instance="a",gpu="1"}', "values": "3x40"},
        {"series": 'DCGM_FI_DEV_GPU_UTIL{instance="b",gpu="0"}', "values": "95x40"},
    ]
    return two_nodes, one_node, work


def test_synthetic_series_fire_exactly_the_expected_alerts(tmp_path: Path) -> None:
    spec = load_stack_spec("dev")  # budget 3000 USD, thresholds 50/80/100 %, checkpointEvery auto
    assert spec.budget.monthly_limit_usd == 3000 and spec.training.checkpoint_every == "auto"
    (tmp_path / "rules.yml").write_text(monitoring.render(spec), encoding="utf-8")
    two_nodes, one_node, work = _synthetic_series()
    labels = {"env": "dev", "node": "0", "workload": "tiny", "cloud": "aws", "group": "aws-train"}

    def pace(pct: int, severity: str, monthly: str) -> dict[str, Any]:
        return _alert({"severity": severity, "env": "dev", "threshold_percent": str(pct)},
                      f"GPU nodes running now cost {monthly} USD a month at this pace: over {pct}% of the dev "
                      "budget (3000 USD); scale node groups down or raise budget.monthlyLimitUsd")

    tests = [
        {"interval": "1m", "input_series": two_nodes, "alert_rule_test": [
            {"eval_time": "20m", "alertname": "GtsBudgetPace", "exp_alerts": []},  # not yet for 30m
            {"eval_time": "40m", "alertname": "GtsBudgetPace",
             "exp_alerts": [pace(50, "warning", "4.468k"), pace(80, "warning", "4.468k"),
                           pace(100, "critical", "4.468k")]},
        ]},
        {"interval": "1m", "input_series": one_node, "alert_rule_test": [
            {"eval_time": "40m", "alertname": "GtsBudgetPace", "exp_alerts": [pace(50, "warning", "2.234k")]},
        ]},
        {"interval": "1m", "input_series": work, "alert_rule_test": [
            {"eval_time": "12m", "alertname": "GtsCheckpointStale", "exp_alerts": []},  # stale, not for 5m yet
            {"eval_time": "20m", "alertname": "GtsCheckpointStale", "exp_alerts": [
                _alert({**labels, "severity": "warning", "instance": "a"},
                       "no checkpoint committed on node 0 for 3 of the intervals it chose (checkpointEvery: auto): "
                       "a reclaim now loses that work")]},
            {"eval_time": "10m", "alertname": "GtsCheckpointUploadsPending", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "GtsCheckpointUploadsPending", "exp_alerts": [
                _alert({**labels, "severity": "warning", "instance": "a"},
                       "2 committed checkpoint(s) on node 0 are not in the bucket yet: the object store is "
                       "unreachable or refusing writes; they stay on local disk and are retried")]},
            {"eval_time": "3m", "alertname": "GtsSpotInterruption", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "GtsSpotInterruption", "exp_alerts": [
                _alert({"severity": "info", "env": "dev", "instance": "c", "cloud": "alicloud"},
                       "the cloud is reclaiming spot node c: the trainer was sent SIGTERM and saves an emergency "
                       "checkpoint")]},
            {"eval_time": "35m", "alertname": "GtsGpuIdle", "exp_alerts": [
                _alert({"severity": "warning", "env": "dev", "instance": "a"},
                       "GPUs on a averaged under 5% for 30m: a paid node doing no work; check the trainer or scale "
                       "the group down")]},
        ]},
    ]
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": tests}))
    result = subprocess.run([promtool(), "test", "rules", "rules.test.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_nodes_report_the_price_their_market_pays() -> None:
    """The budget-pace alert sums what nodes report: spot groups report the spot price."""
    aws = resolve(load_stack_spec("dev")).group("aws-train")
    prices = aws.prices
    assert prices.spot < prices.on_demand
    assert aws.node_hourly_usd == pytest.approx(prices.spot + prices.disk)
    prod = resolve(load_stack_spec("prod"))
    based = next(g for g in prod.groups if g.market.type == "spot" and g.market.on_demand_base > 0)
    p = based.prices
    assert based.node_hourly_usd == pytest.approx(p.on_demand + p.disk)  # cannot tell: errs high


def test_dashboard_shows_every_metric_against_the_budget() -> None:
    spec = load_stack_spec("prod")
    board = monitoring.dashboard(spec)
    panels = board["panels"]
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(cells) == len(panels), "panels overlap"
    budget_line = panels[0]["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]
    assert budget_line == {"color": "red", "value": spec.budget.monthly_limit_usd}
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    trainer_metrics = ["gts_node_hourly_usd", "gts_node_cost_usd", "gts_train_samples_per_second", "gts_train_loss",
                       "gts_train_step_seconds", "gts_checkpoint_last_commit_timestamp_seconds",
                       "gts_checkpoint_seconds", "gts_checkpoint_uploads_pending"]
    for metric in [*trainer_metrics, "DCGM_FI_DEV_GPU_UTIL", "gts_spot_interruption_notice"]:
        assert metric in exprs, f"no panel shows {metric}"
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    assert json.loads(monitoring.render_dashboard(spec)) == board


def test_make_monitoring_writes_both_files_and_names_a_missing_stack(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "infra.cli.monitoring", "--stack", "dev", "--out", str(tmp_path / "m")],
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["alerts-dev.yml", "dashboard-dev.json"]
    result = subprocess.run([sys.executable, "-m", "infra.cli.monitoring", "--stack", "nope", "--out", str(tmp_path / "x")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no stack file Pulumi.nope.yaml; stacks here: dev, prod" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_trainer_metric_a_rule_reads_is_one_the_trainer_exports(stack: str) -> None:
    """The seam rules -> trainer: the gts_* series the rendered alert rules name (gts_spot_* come
    from the spot watcher's textfile) are registered by the trainer's own Metrics, so an alert
    such as the stale checkpoint under checkpointEvery: auto can fire at all."""
    import re

    from training.trainer.metrics import Metrics

    rules = monitoring.render(load_stack_spec(stack))
    used = {n for n in re.findall(r"\bgts_[a-z_]+", rules) if not n.startswith(("gts_spot_", "gts_gpu_"))}  # gts_gpu_*: tests/test_gpu_health_plan.py
    exported = {m.name for m in Metrics(0, 1.0, {"node": "0"}).registry.collect()}
    assert used and used <= exported, used - exported
    if stack == "dev":  # checkpointEvery: auto
        assert "gts_checkpoint_interval_steps" in used
