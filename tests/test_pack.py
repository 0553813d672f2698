"""The policy pack as an organisation runs it, tried as a new user would: the data it ships
equals the project's, a missing SDK stops it loudly, the bypasses that used to pass are caught,
`make plan` and a real preview read the same config, and the plan's exit codes and messages
mean what docs/policies.md says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from policies.gts_policy import resources as pack_resources
from policies.gts_policy import rules, rules_security
from policies.gts_policy.resources import Res
from tests.harness import ROOT, key, project_copy, stack_values, write_stack

TAGS = {"owner": "o", "cost-center": "c", "env": "prod"}


@pytest.mark.parametrize("name", ["gpu_catalog.csv", "prices.csv", "capabilities.yaml", "stateful.yaml"])
def test_the_pack_ships_the_projects_data(name: str) -> None:
    assert (ROOT / "policies/data" / name).read_bytes() == (ROOT / "infra/data" / name).read_bytes(), \
        f"policies/data/{name} differs from infra/data/{name}: run `make policy-data`"


def test_the_pack_imports_nothing_of_the_project() -> None:
    for path in (ROOT / "policies").rglob("*.py"):
        text = path.read_text()
        assert "from infra" not in text and "import infra" not in text and "from policies" not in text, path
        assert "sys.path" not in text, f"{path}: the CLI puts the pack's folder on the path"


def test_a_missing_provider_sdk_stops_the_pack_instead_of_passing_untagged_resources(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def without_aws(name: str, package: str | None = None) -> Any:
        if name.startswith("pulumi_aws"):
            raise ImportError("No module named 'pulumi_aws'")
        return real(name, package)

    pack_resources.taggable.cache_clear()
    monkeypatch.setattr(importlib, "import_module", without_aws)
    try:
        with pytest.raises(pack_resources.PackSetupError, match="needs pulumi_aws .* requirements.txt"):
            rules_security.required_tags(Res("aws:s3/bucket:Bucket", "b", {}), {})
    finally:
        pack_resources.taggable.cache_clear()


# ------------------------------------------------------------------------------ bypasses

def _verdicts(resources: list[Res], config: dict[str, Any]) -> list[dict[str, str]]:
    return rules.evaluate(resources, config)


def test_ingress_split_into_halves_is_still_the_internet() -> None:
    halves = [Res("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", f"ssh-{i}",
                  {"securityGroupId": "sg-1", "cidrIpv4": c, "fromPort": 22, "toPort": 22, "ipProtocol": "tcp"})
              for i, c in enumerate(["0.0.0.0/1", "128.0.0.0/1"])]
    found = [v for v in _verdicts(halves, {}) if v["policy"] == "no-public-ingress"]
    assert sorted(v["resource"] for v in found) == ["ssh-0", "ssh-1"]  # a /1 alone is half the internet
    # Two /8s: each alone could be a (very large) known range, together they are not.
    eights = [Res("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", f"r-{i}",
                  {"securityGroupId": "sg-9", "cidrIpv4": c}) for i, c in enumerate(["1.0.0.0/8", "2.0.0.0/8"])]
    assert not [v for v in _verdicts(eights[:1], {}) if v["policy"] == "no-public-ingress"]
    together = [v for v in _verdicts(eights, {}) if v["policy"] == "no-public-ingress"]
    assert len(together) == 2 and "together admit the whole internet" in together[0]["message"]
    v6 = Res("tencentcloud:Security/groupRuleSet:GroupRuleSet", "rules", {"securityGroupId": "sg-2", "ingresses": [
        {"action": "ACCEPT", "ipv6CidrBlock": "::/1"}, {"action": "ACCEPT", "ipv6CidrBlock": "8000::/1"}]})
    assert [v["resource"] for v in _verdicts([v6], {}) if v["policy"] == "no-public-ingress"] == ["rules"]
    office = [Res("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "office",
                  {"securityGroupId": "sg-3", "cidrIpv4": "203.0.113.0/24"})]
    assert not [v for v in _verdicts(office, {}) if v["policy"] == "no-public-ingress"]


def test_a_schedule_cannot_lift_a_group_past_the_node_and_cost_caps() -> None:
    asg = Res("aws:autoscaling/group:Group", "aws-train-asg", {"maxSize": 2, "minSize": 0, "tags": [
        {"key": "gpu-training-stack:node-group", "value": "aws-train", "propagateAtLaunch": True}],
        "mixedInstancesPolicy": {"instancesDistribution": {"onDemandBaseCapacity": 0,
                                                            "onDemandPercentageAboveBaseCapacity": 0},
                                 "launchTemplate": {"overrides": [{"instanceType": "p4d.24xlarge"}]}}})
    burst = Res("aws:autoscaling/schedule:Schedule", "aws-train-burst",
                {"autoscalingGroupName": "aws-train-asg-0001", "desiredCapacity": 50, "maxSize": 50})
    config = {"gpu-max-nodes": {"maxNodesPerGroup": 16}, "node-group-cost-cap": {"maxHourlyUsdPerGroup": 450}}
    assert not [v for v in _verdicts([asg], config) if v["policy"] in ("gpu-max-nodes", "node-group-cost-cap")]
    found = {v["policy"]: v for v in _verdicts([asg, burst], config)}
    assert "may grow to 50 nodes" in found["gpu-max-nodes"]["message"]
    assert found["node-group-cost-cap"]["enforcement"] == "mandatory"


def _plan(proj: Path, stack: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"], cwd=proj,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})


def test_a_budget_below_the_plan_is_a_mandatory_violation(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    values = stack_values("prod")
    values[key("budget")]["monthlyLimitUsd"] = 100000  # the plan is ~187k
    write_stack(proj, "prod", values)
    proc = _plan(proj, "prod")
    assert proc.returncode == 1, proc.stderr
    (found,) = [v for v in json.loads(proc.stdout)["violations"] if v["policy"] == "budget-covers-plan"]
    assert found["enforcement"] == "mandatory" and "over the monthly budget of $100,000" in found["message"]
    values[key("budget")]["monthlyLimitUsd"] = 200000  # covered, but past the 50% alert
    write_stack(proj, "prod", values)
    verdicts = json.loads(_plan(proj, "prod").stdout)["violations"]
    assert [v["enforcement"] for v in verdicts if v["policy"].startswith("budget")] == ["advisory"]


def test_make_plan_and_a_real_preview_read_the_same_pack_config(tmp_path: Path) -> None:
    """`make policy-config` writes what `--policy-pack-config` gets; the plan's verdicts come from
    exactly that file."""
    out = subprocess.run([sys.executable, "-m", "infra.cli.policy_config", "--stack", "prod", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = json.loads(Path(out.stdout.strip()).read_text())
    assert config["node-group-cost-cap"]["cnyPerUsd"] == stack_values("prod").get(key("pricing"), {}).get("cnyPerUsd", 7.2)
    assert config["budget-covers-plan"]["budgetMonthlyUsd"] == 250000
    from infra.plan.__main__ import build_plan

    plan = build_plan("prod")
    assert config["budget-covers-plan"]["plannedMonthlyUsd"] == plan["cost"]["monthly_usd"]


def test_budget_alerts_need_at_least_one_threshold(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    values = stack_values("dev")
    values[key("budget")]["thresholdsPercent"] = []
    write_stack(proj, "dev", values)
    proc = _plan(proj, "dev")
    assert proc.returncode == 2 and "budget.thresholdsPercent" in proc.stderr


# --------------------------------------------------------------------- exit codes and messages

@pytest.mark.parametrize("what,edit,expected", [
    ("unquoted APPID", lambda v: v[key("clouds")]["tencentcloud"].__setitem__("appId", 1250000000),
     'write the APPID quoted: appId: "1250000000"'),
    ("day names in a Tencent cron", lambda v: v[key("nodeGroups")][2]["schedule"][0].__setitem__(
        "cron", "0 20 * * MON-FRI"), "nodeGroups[2].schedule[0].cron: cron '0 20 * * MON-FRI': write days and months"),
    ("a cron that never fires", lambda v: v[key("nodeGroups")][0]["schedule"][0].__setitem__("cron", "0 0 31 2 *"),
     "nodeGroups[0].schedule[0].cron: '0 0 31 2 *' never fires"),
    ("a CIDR with host bits", lambda v: v[key("networks")][0].__setitem__("cidr", "10.10.0.1/16"),
     "networks[0].cidr: '10.10.0.1/16' has host bits set; the network is 10.10.0.0/16"),
    ("a price for an unknown type", lambda v: v.__setitem__(key("pricing"), {"overrides": [
        {"cloud": "aws", "instanceType": "p4d.24xlarg", "onDemandHourly": 3}]}),
     "pricing.overrides[0].instanceType: 'p4d.24xlarg' is not an AWS type in the catalog; did you mean 'p4d.24xlarge'?"),
    ("a misspelled project namespace", lambda v: v.__setitem__("gpu-trainig-stack:budget", v.pop(key("budget"))),
     "gpu-trainig-stack:budget: is under 'gpu-trainig-stack', not this project's"),
    ("SSH split into halves", lambda v: v[key("networks")][0].__setitem__("sshCidrs", ["0.0.0.0/1", "128.0.0.0/1"]),
     "networks[0].sshCidrs[1]: 128.0.0.0/1 opens SSH to the internet"),
    ("SSH split into /8s", lambda v: v[key("networks")][0].__setitem__("sshCidrs", ["1.0.0.0/8", "2.0.0.0/8"]),
     "networks[0].sshCidrs: 1.0.0.0/8, 2.0.0.0/8 together open SSH to the internet"),
])
def test_user_errors_exit_2_naming_the_key(what: str, edit: Any, expected: str, tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    values = stack_values("dev")
    edit(values)
    write_stack(proj, "dev", values)
    proc = _plan(proj, "dev")
    assert proc.returncode == 2, f"{what}: {proc.returncode} {proc.stderr[-500:]}"
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_an_internal_error_exits_3_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from infra.plan import __main__ as plan_main

    def broken(stack: str, against: Path | None = None) -> dict[str, Any]:
        raise KeyError("a bug")

    monkeypatch.setattr(plan_main, "build_plan", broken)
    assert plan_main.main(["--stack", "dev"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("internal error: KeyError") and "--debug" in err
    assert plan_main.main(["--stack", "dev", "--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_a_secret_nested_in_training_is_masked_and_stays_a_secret(tmp_path: Path) -> None:
    """`pulumi config set --secret --path training.mlflowTrackingUri …` writes a nested `secure:`:
    the spec takes it, the plan masks it, and the program hands every value rendered from it to
    the engine as a secret (the VM user data, the Job's env)."""
    proj = project_copy(tmp_path)
    values = stack_values("prod")
    values[key("training")]["mlflowTrackingUri"] = {"secure": "v1:c2VjcmV0LWNpcGhlcnRleHQ="}
    write_stack(proj, "prod", values)
    proc = _plan(proj, "prod")
    assert proc.returncode == 0, proc.stderr
    assert "c2VjcmV0LWNpcGhlcnRleHQ" not in proc.stdout
    plan = json.loads(proc.stdout)
    lt = next(r for r in plan["resources"] if r["name"] == "aws-train-lt")
    assert lt["inputs"]["userData"] == "[secret]"
    job = next(r for r in plan["resources"] if r["name"] == "aws-eks-train-job")
    env = {e["name"]: e for e in job["inputs"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["CHECKPOINT_URL"]["value"].startswith("s3://"), "the Job's spec stays readable"
    ref = env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]
    held = next(r for r in plan["resources"] if r["type"] == "kubernetes:core/v1:Secret"
                and r["inputs"]["metadata"]["name"] == ref["name"])
    assert held["inputs"]["stringData"] == "[secret]"
