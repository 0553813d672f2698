"""The friction a new user meets (issue 48): a plan table that fits the terminal, `make help` as
the default goal, `--help` of the node tools, messages that name the near miss and do not send
the user after a typo, and errors on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from infra.core.errors import SpecError
from infra.plan import report
from infra.plan.__main__ import build_plan
from tests.harness import ROOT, key, project_copy, spec_raw, stack_values
from tests.harness import parse_spec as parse
from tests.teams_helpers import make_teams, teams_project

TODAY = "2026-11-30"


@pytest.fixture(scope="module")
def dev_plan() -> dict[str, object]:
    return build_plan("dev")


@pytest.mark.parametrize("columns", [60, 80, 99])
def test_the_plan_table_fits_a_narrow_terminal(dev_plan: dict[str, object], columns: int) -> None:
    console = Console(width=columns, record=True, file=open(os.devnull, "w"), color_system=None)
    report.print_plan(dev_plan, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= columns
    assert "cost by node group" in text and "aws-train" in text and "$/month" in text
    assert "spot cap /node-h" not in text  # the narrow layout: the columns that name a row and its cost


def test_the_wide_table_keeps_every_column(dev_plan: dict[str, object]) -> None:
    console = Console(width=240, record=True, file=open(os.devnull, "w"), color_system=None)
    report.print_plan(dev_plan, console)
    text = console.export_text()
    assert "spot cap /node-h" in text and "key inputs" in text and "shared FS" in text


@pytest.mark.parametrize("isatty,environ,want", [
    (True, {"COLUMNS": "70"}, None), (False, {}, 180), (False, {"COLUMNS": "90"}, 90), (False, {"COLUMNS": "x"}, 180)])
def test_the_table_width_follows_the_terminal_or_columns(isatty: bool, environ: dict[str, str], want: int | None) -> None:
    assert report.width(isatty, environ) == want


def test_make_plan_in_a_90_column_pipe_fits(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", "dev"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                       "GTS_TODAY": TODAY, "COLUMNS": "90"})
    assert proc.returncode in (0, 1), proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 90


def test_a_bare_make_lists_every_target() -> None:
    proc = subprocess.run(["make", "-s"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "up to date" not in proc.stdout
    documented = [line[3:].split(":", 1)[0] for line in (ROOT / "Makefile").read_text().splitlines()
                  if line.startswith("## ")]
    listed = [line.split()[0] for line in proc.stdout.splitlines()]
    assert listed == documented and {"plan", "teams", "train-local", "help"} <= set(listed)
    assert "$$" not in proc.stdout


@pytest.mark.parametrize("module,says", [("training.contract", "usage: python -m training.contract check|table"),
                                         ("training.node.rdzv_launch", "torchrun with a rendezvous whose state")])
def test_node_tools_answer_help(module: str, says: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RDZV_KEY"}
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.startswith(says)


def test_an_unknown_team_is_one_readable_line(tmp_path: Path) -> None:
    proc = make_teams(teams_project(tmp_path), "--team", "zzz")
    assert proc.returncode == 2
    assert "TEAM=zzz: no such team in teams.yaml (teams: vision, nlp, speech)" in proc.stderr


def test_a_price_dated_after_today_says_the_clock_is_behind(dev_plan: dict[str, object]) -> None:
    console = Console(width=200, record=True, file=open(os.devnull, "w"), color_system=None)
    cost = dict(dev_plan["cost"])  # type: ignore[call-overload]
    cost["prices"] = {**cost["prices"], "age_days": -12}
    report.print_plan({**dev_plan, "cost": cost}, console)
    text = console.export_text()
    assert "dated 12 days after today: the clock or GTS_TODAY is behind" in text and "-12 days" not in text


def test_a_region_typo_is_named_once_without_a_prices_errand(tmp_path: Path) -> None:
    config = stack_values("dev")
    config[key("clouds")]["aws"]["region"] = "us-esat-1"
    with pytest.raises(SpecError) as caught:
        parse(spec_raw(config))
    problems = [str(p) for p in caught.value.problems]
    assert any(p.startswith("clouds.aws.region: 'us-esat-1'") and "did you mean 'us-east-1'" in p for p in problems)
    assert not any("make prices" in p for p in problems), problems


def test_an_a10g_group_names_the_near_miss_and_what_would_do() -> None:
    config = stack_values("dev")
    group = config[key("nodeGroups")][0]
    assert group["cloud"] == "aws"
    group.pop("instanceType", None)
    group["gpu"] = {"model": "A10G", "count": 1}
    with pytest.raises(SpecError) as caught:
        parse(spec_raw(config))
    [problem] = [str(p) for p in caught.value.problems]
    assert "near misses: g5.12xlarge (4 GPUs, not 1 — would do with count: 4)" in problem
    assert "g5.xlarge (16 GiB RAM, under 1.5 x 24 GB of GPU memory)" in problem
    group.pop("gpu")
    group["instanceType"] = "g5.xlarge"
    with pytest.raises(SpecError) as caught:
        parse(spec_raw(config))
    assert "pick a larger type such as g5.12xlarge (4 x A10G, 192 GiB)" in str(caught.value)


def test_make_prices_errors_go_to_stderr(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "infra.prices.refresh", "--region", "us-esat-1"], cwd=proj,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stdout == "" and "REGION needs one CLOUD" in proc.stderr
