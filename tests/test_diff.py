"""`make diff` on real changes of the shipped stacks, in a git repository of its own (a copy of
this project): each changed resource is named, the cost delta is the difference of the two
plans' own costs, and replacements of data- or capacity-holding resources are flagged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import ROOT

STACK_FILE = "Pulumi.prod.yaml"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's files (tracked and new, as a clean clone would have them) in a fresh git
    repository, committed once: the base every change here is compared with."""
    path = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, path / rel)
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@example.com", "-c", "user.name=t",
                                                   "commit", "-qm", "base"]):
        subprocess.run(["git", *args], cwd=path, check=True)
    return path


def _edit(repo: Path, change: Any) -> None:
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=True)
    data = yaml.safe_load((repo / STACK_FILE).read_text())
    change(data["config"])
    (repo / STACK_FILE).write_text(yaml.safe_dump(data, sort_keys=False))


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=repo, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})


def _diff(repo: Path) -> tuple[int, dict[str, Any], str]:
    """The command's JSON, and the Markdown the command renders from the same report."""
    from infra.plan import markdown

    as_json = _run(repo, "infra.cli.diff", "--base", "HEAD", "--stack", "prod", "--format", "json")
    assert as_json.returncode in (0, 1), as_json.stderr
    report = json.loads(as_json.stdout)["stacks"][0]
    return as_json.returncode, report, markdown.render([report], "HEAD")


def _monthly(repo: Path) -> float:
    proc = _run(repo, "infra.plan", "--stack", "prod", "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    return float(json.loads(proc.stdout)["cost"]["monthly_usd"])


def _groups(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in config["gpu-training-stack:nodeGroups"]}


def test_scaling_a_group_and_switching_a_market(repo: Path) -> None:
    before = _monthly(repo)  # the shipped stack, as committed

    def change(config: dict[str, Any]) -> None:
        groups = _groups(config)
        groups["aws-train"]["scaling"].update(max=10, desired=3)
        groups["ali-train"]["market"] = {"type": "on-demand"}
    _edit(repo, change)
    code, report, md = _diff(repo)
    assert code == 0, md
    changed = {r["name"]: r["inputs"] for r in report["resources"]["changed"]}
    assert "maxSize" in changed["aws-train-asg"] and "desiredCapacity" in changed["aws-train-asg"]
    assert "spotStrategy" in changed["ali-train-lt"]
    assert report["resources"]["replaced"] == []
    after = _monthly(repo)
    assert report["cost"]["total"]["delta"] == pytest.approx(after - before, abs=0.02)
    assert report["cost"]["node_groups"]["ali-train"]["delta"] > 0
    assert "| ali-train |" in md and "~ change" in md and "aws-train-asg" in md


def test_adding_a_network_and_a_peering(repo: Path) -> None:
    def change(config: dict[str, Any]) -> None:
        config["gpu-training-stack:networks"].append(
            {"name": "aws-eval", "cloud": "aws", "cidr": "10.30.0.0/16",
             "subnets": [{"zone": "us-east-1a", "cidr": "10.30.0.0/20"}]})
        config["gpu-training-stack:peerings"].append({"name": "aws-train-eval", "requester": "aws-train",
                                                      "accepter": "aws-eval"})
    _edit(repo, change)
    code, report, _ = _diff(repo)
    assert code == 0
    added = {(r["type"], r["name"]) for r in report["resources"]["added"]}
    assert ("aws:ec2/vpc:Vpc", "aws-eval-vpc") in added
    assert any(t == "aws:ec2/vpcPeeringConnection:VpcPeeringConnection" for t, _ in added)
    assert report["resources"]["removed"] == [] and report["resources"]["replaced"] == []


def test_a_change_that_replaces_a_node_group_is_flagged(repo: Path) -> None:
    def change(config: dict[str, Any]) -> None:
        # (the inference pool: the training pools hold the shared teams' queues, teams.yaml)
        eks = _groups(config)["aws-eks-infer"]
        eks["instanceType"] = "g6e.12xlarge"  # instance_types cannot change in place (EKS)
    _edit(repo, change)
    code, report, md = _diff(repo)
    assert code == 0, md
    replaced = {r["name"]: r["why"] for r in report["resources"]["replaced"]}
    assert replaced and all(name.startswith("aws-eks-infer") for name in replaced)
    assert all("instanceTypes changes" in why for why in replaced.values())
    assert "[!WARNING]" in md and "Replaced or deleted" in md


def test_a_new_mandatory_violation_exits_1_and_a_bad_ref_exits_2(repo: Path) -> None:
    def change(config: dict[str, Any]) -> None:
        config["gpu-training-stack:budget"]["monthlyLimitUsd"] = 1000
    _edit(repo, change)
    code, report, md = _diff(repo)
    assert code == 1
    assert [v["policy"] for v in report["violations"]["new"] if v["enforcement"] == "mandatory"] == ["budget-covers-plan"]
    assert ":x: new mandatory `budget-covers-plan`" in md
    md_cli = _run(repo, "infra.cli.diff", "--base", "HEAD", "--stack", "prod")
    assert md_cli.returncode == 1 and md_cli.stdout == md, "make diff prints what the report renders"
    bad = _run(repo, "infra.cli.diff", "--base", "no-such-ref")
    assert bad.returncode == 2 and "no-such-ref" in bad.stderr


def test_a_team_added_by_pull_request_shows_its_stack_and_cost(repo: Path) -> None:
    """The platform team's workflow: a PR adds a team to teams.yaml, `make teams` writes its
    generated stack, and `make diff` shows the new stack's resources and cost."""
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=True)
    registry = yaml.safe_load((repo / "teams.yaml").read_text())
    audio = json.loads(json.dumps(registry["teams"][0]))  # the isolated team as a template
    audio.update(name="audio", costCenter="cc-4500", monthlyBudgetUsd=12000, gpus={"aws": {"A100": 8}})
    audio["stack"]["networks"][0].update(name="audio-train", cidr="10.120.0.0/16",
                                         subnets=[{"zone": "us-east-1a", "cidr": "10.120.0.0/20"}])
    audio["stack"]["nodeGroups"][0].update(name="audio-train", network="audio-train",
                                           scaling={"min": 0, "max": 1, "desired": 1})
    registry["teams"].append(audio)
    registry["org"]["gpus"]["aws"]["A100"] += 8
    (repo / "teams.yaml").write_text(yaml.safe_dump(registry, sort_keys=False))
    try:
        teams = _run(repo, "infra.teams.report", "--team", "audio", "--format", "json")
        assert teams.returncode == 0, teams.stderr
        assert "wrote Pulumi.team-audio.yaml" in teams.stderr
        as_json = _run(repo, "infra.cli.diff", "--base", "HEAD", "--stack", "team-audio", "--format", "json")
        assert as_json.returncode == 0, as_json.stderr
        report = json.loads(as_json.stdout)["stacks"][0]
        added = {r["type"] for r in report["resources"]["added"]}
        assert "aws:autoscaling/group:Group" in added and "aws:s3/bucket:Bucket" in added
        cost = json.dumps(report["cost"])
        assert "audio-train" in cost
    finally:
        (repo / "Pulumi.team-audio.yaml").unlink(missing_ok=True)
