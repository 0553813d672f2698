"""The teams' Automation API driver (infra/teams/__main__.py): its own logic — order, selection,
failure, summary — driven over the real offline plan by a runner that stands in for the Pulumi CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from infra.plan.__main__ import build_plan
from infra.teams import registry
from infra.teams import __main__ as driver
from tests.harness import ROOT


# ----------------------------------------------------------- the Automation API driver

class OfflineRunner:
    """Stands in for `pulumi.automation`: plans the stack it is handed offline, with the config
    file and policy config the driver chose, and records the order. (The CLI runs each stack in a
    process of its own; the mock engine is one per process, so plans here take turns.)"""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, job: driver.Run, op: driver.Operation, on_output: Any, on_event: Any) -> driver.Outcome:
        self.calls.append((op, job.stack))
        assert job.config_file.name == f"Pulumi.{job.stack}.yaml" and job.config_file.exists()
        policy = json.loads(job.policy_config.read_text())
        if job.stack.startswith("team-"):
            assert policy["team-gpu-quota"]["team"] == job.stack.removeprefix("team-")
        with self.lock:
            asyncio.set_event_loop(asyncio.new_event_loop())  # the driver's worker thread has none
            plan = build_plan(job.stack)
        on_output(f"{len(plan['resources'])} resources")
        if job.stack == self.fail:
            return driver.Outcome(job.stack, False, error="boom")
        return driver.Outcome(job.stack, True, {"create": len(plan["resources"])})


def test_driver_runs_the_shared_stack_first_then_the_teams(capsys: pytest.CaptureFixture[str]) -> None:
    runner = OfflineRunner()
    assert driver.main(["up", "--all", "--parallel", "2"], runner=runner) == 0
    assert runner.calls[0] == ("up", "prod") and sorted(runner.calls[1:]) == [("up", "team-vision")]
    out = capsys.readouterr().out
    assert "pulumi up: 2 of 2 stacks succeeded" in out and "create" in out


def test_driver_selection_rules() -> None:
    reg = registry.load(ROOT)
    assert driver.select(reg, "preview", ["nlp"], False) == [["prod"]]
    assert driver.select(reg, "preview", ["vision"], False) == [["team-vision"]]
    assert driver.select(reg, "destroy", [], True) == [["team-vision"]]  # never the shared stack
    with pytest.raises(ValueError, match="queue.*on the shared stack"):
        driver.select(reg, "destroy", ["nlp"], False)
    with pytest.raises(ValueError, match="did you mean 'vision'"):
        driver.select(reg, "up", ["visoin"], False)
    with pytest.raises(ValueError, match="--team NAME"):
        driver.select(reg, "up", [], False)


def test_driver_stops_after_a_failed_shared_stack(capsys: pytest.CaptureFixture[str]) -> None:
    runner = OfflineRunner(fail="prod")
    assert driver.main(["preview", "--all"], runner=runner) == 1
    assert runner.calls == [("preview", "prod")]
    out = capsys.readouterr().out
    assert "skipped: an earlier stack failed" in out and "boom" in out


def test_driver_without_a_pulumi_cli_says_so_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "infra.teams", "preview", "--all"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert result.stdout.strip().count("\n") == 0 and "make teams" in result.stdout


def test_driver_summary_table() -> None:
    console = Console(width=200, record=True)
    console.print(driver.summary([driver.Outcome("team-a", True, {"create": 3}, 12.0),
                                  driver.Outcome("team-b", False, error="quota")], "up"))
    text = console.export_text()
    assert "1 of 2 stacks succeeded" in text and "create 3" in text and "FAILED" in text and "quota" in text
