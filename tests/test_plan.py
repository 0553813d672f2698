"""The stack program in the mock engine, and `make plan`'s output contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.resolve.cost import stack_cost
from infra.resolve.groups import resolve
from tests.harness import ROOT
from tests.harness import parse_spec as parse
from tests.harness import by_type, key, project_copy, run_stack, shipped, spec_raw, stack_values, write_stack


def _plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_dev_registers_one_platform_and_provider_per_cloud() -> None:
    resources = list(shipped("dev"))
    for cloud in ("aws", "alicloud", "tencentcloud"):
        platforms = by_type(resources, f"gpu-training-stack:{cloud}:Platform")
        assert [p.name for p in platforms] == [f"dev-{cloud}"]
        providers = by_type(resources, f"pulumi:providers:{cloud}")
        assert len(providers) == 1, "dev is one region per cloud"
        assert providers[0].parent == platforms[0].urn


def test_prod_has_a_provider_per_region() -> None:
    resources = list(shipped("prod"))
    regions = sorted(r.inputs["region"] for r in by_type(resources, "pulumi:providers:aws"))
    assert regions == ["us-east-1", "us-west-2"]


def test_every_platform_exports_the_same_outputs() -> None:
    from infra.plan.engine import unwrap_secrets

    for cloud in ("aws", "alicloud", "tencentcloud"):
        (platform,) = by_type(list(shipped("prod")), f"gpu-training-stack:{cloud}:Platform")
        out = platform.outputs
        assert set(out) == {"vpcIds", "bucket", "checkpointUrl", "fleets", "clusters", "kubeconfigs", "trainerImage"}, cloud
        assert "@sha256:" in out["trainerImage"], "nodes run the image by digest, never by a tag that can move"
        assert len(out["vpcIds"]) == 3 and out["checkpointUrl"].endswith("/checkpoints/")
        fleets = unwrap_secrets(out["fleets"])
        assert fleets and all(isinstance(v, list) and v and all(isinstance(x, str) for x in v) for v in fleets.values())
        assert rpc_secret(out["kubeconfigs"]), "kubeconfigs are exported as a secret"


def rpc_secret(value: object) -> bool:
    from pulumi.runtime import rpc

    return bool(rpc.is_rpc_secret(value))


def test_bad_spec_registers_nothing(tmp_path: Path) -> None:
    def edit(v: dict[str, Any]) -> None:
        v[key("budget")]["monthlyLimitUsd"] = 0
    with pytest.raises(pulumi.RunError, match="budget.monthlyLimitUsd"):
        run_stack("dev", edit, tmp_path)


def test_plan_json_is_one_document_with_the_contract() -> None:
    proc = _plan("--stack", "prod", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert set(plan) >= {"stack", "resources", "cost", "violations"}
    assert plan["stack"] == "prod"
    assert all(set(r) >= {"type", "name", "inputs"} for r in plan["resources"])
    assert {"hourly_usd", "monthly_usd", "by_cloud"} <= set(plan["cost"])
    # The cost printed is the catalog arithmetic for the same stack file.
    expected = stack_cost(resolve(parse(spec_raw(stack_values("prod")))))
    assert plan["cost"]["monthly_usd"] == expected["monthly_usd"]
    assert plan["cost"]["by_cloud"] == expected["by_cloud"]


def test_plan_table_lists_resources_and_cost() -> None:
    proc = _plan("--stack", "dev")
    assert proc.returncode == 0, proc.stderr
    assert "pulumi:providers:aws" in proc.stdout and "dev-aws-us-east-1" in proc.stdout
    assert "cost by cloud" in proc.stdout


def test_plan_reads_any_stack_file_and_rejects_bad_ones(tmp_path: Path) -> None:
    # The plan reads Pulumi.<name>.yaml next to Pulumi.yaml: run it from a copy of the project.
    proj = project_copy(tmp_path)
    values = stack_values("dev")
    values[key("nodeGroups")][0]["instanceType"] = "p5.48xlarg"
    del values[key("nodeGroups")][0]["gpu"]
    write_stack(proj, "team-a", values)
    proc = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv=['plan','--stack','team-a'];"
                           "runpy.run_module('infra.plan', run_name='__main__')"],
                          cwd=proj, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})
    assert proc.returncode == 2
    assert "nodeGroups[0].instanceType" in proc.stderr and "did you mean 'p5.48xlarge'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_missing_stack_file_says_which_exist() -> None:
    proc = _plan("--stack", "staging")
    assert proc.returncode == 2
    assert "Pulumi.staging.yaml" in proc.stderr and "dev, prod" in proc.stderr
