"""`make teams` run as a user runs it on a project copy of the teams registry (teams.yaml): its
report, a good registry, and hostile or impossible edits refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra.plan.__main__ import build_plan
from infra.resolve.groups import resolve
from infra.stack.stackfile import load_stack_spec
from infra.teams import queues
from tests.teams_helpers import make_teams, teams_project


# ------------------------------------------------------------------------- make teams

def test_make_teams_reports_every_team_and_the_org(tmp_path: Path) -> None:
    proj = teams_project(tmp_path)
    result = make_teams(proj, "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    teams = {t["team"]: t for t in report["teams"]}
    assert teams["vision"]["gpus"] == [{"cloud": "aws", "model": "A100", "used": 16, "granted": 16}]
    assert teams["nlp"]["gpus"] == [{"cloud": "aws", "model": "H100", "used": 16, "granted": 16}]
    assert teams["speech"]["resources"] >= 2 * 5  # namespace, role, binding, ClusterQueue, LocalQueue per cluster
    plan = build_plan("prod")
    assert report["org"]["monthly_usd"] == pytest.approx(teams["vision"]["monthly_usd"] + plan["cost"]["monthly_usd"])
    # the shared teams' showback: their whole quota busy at the flavors' GPU-hour
    flavor = queues.flavors(resolve(load_stack_spec("prod")), "aws")["aws-h100-spot"]
    assert teams["nlp"]["hourly_usd"] == pytest.approx(16 * flavor.gpu_hourly_usd, rel=1e-3)
    table = make_teams(proj, "--team", "nlp")
    assert table.returncode == 0 and "nlp" in table.stdout and "vision" not in table.stdout


def test_a_team_asking_more_than_the_org_has_is_refused(tmp_path: Path) -> None:
    def greedy(data: dict[str, Any]) -> None:
        data["teams"][1]["gpus"]["aws"]["H100"] = 40  # the org has 32

    result = make_teams(teams_project(tmp_path, greedy))
    assert result.returncode == 2
    assert "org.gpus.aws.H100" in result.stderr and "nlp 40" in result.stderr and "Traceback" not in result.stderr


def test_a_team_on_a_cloud_the_org_does_not_use_is_refused(tmp_path: Path) -> None:
    def elsewhere(data: dict[str, Any]) -> None:
        data["org"]["gpus"].pop("tencentcloud")

    result = make_teams(teams_project(tmp_path, elsewhere))
    assert result.returncode == 2
    assert "teams[2].gpus.tencentcloud" in result.stderr and "speech" in result.stderr


def test_quotas_the_shared_pools_cannot_hold_are_refused(tmp_path: Path) -> None:
    def crowded(data: dict[str, Any]) -> None:
        data["teams"][2]["gpus"]["tencentcloud"]["V100"] = 24  # spot pool: 3 nodes x 8, prod's Job holds 8

    result = make_teams(teams_project(tmp_path, crowded))
    assert result.returncode == 2
    assert "kubernetes.queues" in result.stderr and "tencentcloud-v100-spot" in result.stderr
    assert "teams[2].gpus.tencentcloud" in result.stderr


def test_a_team_stack_over_its_budget_or_quota_fails_naming_the_team(tmp_path: Path) -> None:
    def bigger(data: dict[str, Any]) -> None:
        vision = data["teams"][0]
        vision["monthlyBudgetUsd"] = 3000
        vision["stack"]["nodeGroups"][0]["scaling"] = {"min": 0, "max": 3, "desired": 1}  # 24 A100 > 16

    result = make_teams(teams_project(tmp_path, bigger), "--team", "vision", "--format", "json")
    assert result.returncode == 1, result.stderr
    assert "wrote Pulumi.team-vision.yaml" in result.stderr  # regenerated from the edited registry
    [team] = json.loads(result.stdout)["teams"]
    hits = {v["policy"]: v["message"] for v in team["violations"] if v["enforcement"] == "mandatory"}
    assert "team vision" in hits["team-gpu-quota"] and "24 A100" in hits["team-gpu-quota"]
    assert "budget" in hits["budget-covers-plan"]


def test_a_team_stack_outside_its_regions_is_invalid(tmp_path: Path) -> None:
    def moved(data: dict[str, Any]) -> None:
        data["teams"][0]["stack"]["networks"][0]["region"] = "us-west-2"

    result = make_teams(teams_project(tmp_path, moved), "--team", "vision")
    assert result.returncode == 2
    assert "networks[0]" in result.stderr and "team vision may use aws regions us-east-1" in result.stderr


def test_check_mode_finds_drift_and_writes_nothing(tmp_path: Path) -> None:
    def renamed(data: dict[str, Any]) -> None:
        data["teams"][0]["costCenter"] = "cc-9999"

    proj = teams_project(tmp_path, renamed)
    before = (proj / "Pulumi.team-vision.yaml").read_text()
    result = make_teams(proj, "--check")
    assert result.returncode == 2 and "Pulumi.team-vision.yaml differs from the registry" in result.stderr
    assert (proj / "Pulumi.team-vision.yaml").read_text() == before


def test_bad_registry_shapes_name_the_key(tmp_path: Path) -> None:
    def broken(data: dict[str, Any]) -> None:
        data["teams"][1]["placment"] = "shared"
        data["teams"][2]["stack"] = data["teams"][0]["stack"]

    result = make_teams(teams_project(tmp_path, broken))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "teams[1].placment: unknown key; did you mean 'placement'?" in result.stderr
    assert "teams[2]" in result.stderr and "shared team queues on the shared clusters" in result.stderr


@pytest.mark.parametrize("what,edit,expected", [
    ("a team named after a stack takes its buckets", lambda d: d["teams"][0].__setitem__("name", "dev"),
     ["teams[0].name", "'gts-dev' is Pulumi.dev.yaml's"]),
    ("a prefix too long for a bucket name", lambda d: d["org"].__setitem__("name", "a" * 28),
     ["teams[0].name", "over 32 characters"]),
    ("a network on a cloud the team has no region on", lambda d: d["teams"][0]["stack"]["networks"].append(
        {"name": "vt-tc", "cloud": "tencentcloud", "cidr": "10.111.0.0/16",
         "subnets": [{"zone": "ap-guangzhou-3", "cidr": "10.111.0.0/20"}]}),
     ["teams[0].stack.networks[1].cloud", "no tencentcloud region"]),
    ("an empty region list", lambda d: d["teams"][0]["regions"].__setitem__("aws", []),
     ["teams[0].regions.aws", "at least 1 item"]),
    ("a quota of 0, true or a string", lambda d: d["teams"][1]["gpus"]["aws"].update(H100=0) or
     d["teams"][2]["gpus"]["alicloud"].update(V100=True) or d["teams"][2]["gpus"]["tencentcloud"].update(V100="8"),
     ["teams[1].gpus.aws.H100", "teams[2].gpus.alicloud.V100", "teams[2].gpus.tencentcloud.V100"]),
    ("an endless budget", lambda d: d["org"].__setitem__("monthlyBudgetUsd", float("inf")),
     ["org.monthlyBudgetUsd", "finite"]),
    ("a shared stack that shares nothing", lambda d: d["org"].__setitem__("sharedStack", "dev"),
     ["org.sharedStack", "Pulumi.dev.yaml does not set kubernetes.queues: teams.yaml"]),
    ("a schema version this tool does not read", lambda d: d.__setitem__("version", 2), ["version", "use one of 1"]),
    ("an org GPU model the catalog does not have", lambda d: d["org"]["gpus"]["aws"].update(h100=8),
     ["org.gpus.aws.h100", "use one of"]),
    ("a shared team outside the shared cluster's region", lambda d: d["teams"][1]["regions"].__setitem__(
        "aws", ["eu-west-1"]), ["teams[1].regions.aws", "cluster is in us-east-1"]),
    ("an on-demand share the pools cannot hold", lambda d: d["teams"][1]["markets"].__setitem__("onDemandBaseMax", 1),
     ["aws-h100-on-demand", "markets.onDemandBaseMax"]),
    ("a generated stack that is not a valid stack", lambda d: d["teams"][0]["stack"]["nodeGroups"][0].__setitem__(
        "sharedFs", True), ["teams[0].stack.nodeGroups[0].sharedFs"]),
])
def test_hostile_registries_are_refused_naming_the_key(tmp_path: Path, what: str, edit: Any,
                                                       expected: list[str]) -> None:
    proj = teams_project(tmp_path, edit)
    before = (proj / "Pulumi.team-vision.yaml").read_text()
    result = make_teams(proj)
    assert result.returncode == 2, (what, result.stdout, result.stderr)
    for text in expected:
        assert text in result.stderr, (what, text, result.stderr)
    assert "Traceback" not in result.stderr
    assert (proj / "Pulumi.team-vision.yaml").read_text() == before, "nothing is written from a refused registry"


def test_hand_written_stacks_and_repeated_keys(tmp_path: Path) -> None:
    def claim(data: dict[str, Any]) -> None:
        data["teams"][0]["name"] = "foo"

    proj = teams_project(tmp_path, claim)
    (proj / "Pulumi.team-foo.yaml").write_text("config: {}\n")  # a stack someone wrote by hand
    result = make_teams(proj)
    assert result.returncode == 2 and "Pulumi.team-foo.yaml exists and is hand-written" in result.stderr
    assert (proj / "Pulumi.team-foo.yaml").read_text() == "config: {}\n"
    (tmp_path / "b").mkdir()
    proj2 = teams_project(tmp_path / "b")
    text = (proj2 / "teams.yaml").read_text().replace("    gpus: {aws: {H100: 16}}\n",
                                                     "    gpus: {aws: {H100: 16}}\n    gpus: {aws: {H100: 32}}\n")
    (proj2 / "teams.yaml").write_text(text)
    twice = make_teams(proj2)
    assert twice.returncode == 2 and "'gpus' is given twice" in twice.stderr
    (proj2 / "teams.yaml").write_text("- just a list\n")
    assert "must be a mapping with version: 1, org and teams" in make_teams(proj2).stderr
