"""Spec validation: every bad input named in the foundation issue gives a clear error naming
the key path, and nothing is registered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from infra.core.errors import SpecError
from infra.resolve.groups import resolve
from tests.harness import parse_spec as parse
from tests.harness import key, spec_raw, stack_values

Edit = Callable[[dict[str, Any]], None]


def _parse(stack: str, edit: Edit) -> str:
    values = stack_values(stack)
    edit(values)
    with pytest.raises(SpecError) as info:
        parse(spec_raw(values), f"Pulumi.{stack}.yaml")
    return str(info.value)


def test_shipped_stacks_are_valid() -> None:
    for stack in ("dev", "prod"):
        spec = parse(spec_raw(stack_values(stack)))
        assert spec.env == stack
        assert set(spec.clouds) == {"aws", "alicloud", "tencentcloud"}


def _group(v: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return v[key("nodeGroups")][i]  # type: ignore[no-any-return]


CASES: list[tuple[str, str, Edit, list[str]]] = [
    ("unknown cloud", "dev", lambda v: v[key("clouds")].__setitem__("azure", {"region": "eastus"}),
     ["clouds.azure:", "use one of aws, alicloud, tencentcloud"]),
    ("unknown region", "dev", lambda v: v[key("clouds")]["aws"].__setitem__("region", "us-eastt-1"),
     ["clouds.aws.region", "us-eastt-1", "did you mean 'us-east-1'"]),
    ("instance type typo", "prod", lambda v: _group(v).__setitem__("instanceType", "p4d.24xlarg"),
     ["nodeGroups[0].instanceType", "p4d.24xlarg", "did you mean 'p4d.24xlarge'"]),
    ("type of another cloud", "dev", lambda v: _group(v, 2).__setitem__("instanceType", "p3.2xlarge"),
     ["nodeGroups[2].instanceType", "'p3.2xlarge' is a GPU type of AWS, but the group is on Tencent Cloud"]),
    ("gpu model not offered", "dev", lambda v: _group(v, 1)["gpu"].__setitem__("model", "H100"),
     ["nodeGroups[1].gpu.model", "'H100' is not offered on Alibaba Cloud"]),
    ("gpu model typo", "dev", lambda v: _group(v)["gpu"].__setitem__("model", "V10"),
     ["nodeGroups[0].gpu.model", "did you mean 'V100'"]),
    ("zero gpus", "dev", lambda v: _group(v)["gpu"].__setitem__("count", 0),
     ["nodeGroups[0].gpu.count", "greater than or equal to 1"]),
    ("min > max", "dev", lambda v: _group(v).__setitem__("scaling", {"min": 3, "max": 2}),
     ["nodeGroups[0].scaling", "min (3) is greater than max (2)"]),
    ("overlapping peered CIDRs", "prod", lambda v: v[key("networks")][1].update(
        cidr="10.10.0.0/16", subnets=[{"zone": "us-east-1a", "cidr": "10.10.128.0/20"}]),
     ["peerings[0]", "overlapping CIDRs"]),
    ("subnet outside VPC", "dev", lambda v: v[key("networks")][0]["subnets"][0].__setitem__("cidr", "10.99.0.0/20"),
     ["networks[0].subnets[0].cidr", "outside the network's CIDR 10.10.0.0/16"]),
    ("missing tag", "dev", lambda v: v[key("tags")].pop("cost-center"),
     ["tags.cost-center", "required tag is missing"]),
    ("non-positive budget", "dev", lambda v: v[key("budget")].__setitem__("monthlyLimitUsd", 0),
     ["budget.monthlyLimitUsd", "greater than 0"]),
    ("checkpoint interval 0", "dev", lambda v: v[key("training")].__setitem__("checkpointEvery", 0),
     ["training.checkpointEvery", "a whole number of steps above 0, or auto"]),
    ("tencent international spot", "dev", lambda v: v[key("clouds")]["tencentcloud"].__setitem__("site", "international"),
     ["nodeGroups[2].market.type", "international-site Tencent Cloud account", "SPOTPAID"]),
    ("misspelled key", "dev", lambda v: _group(v).__setitem__("instanceTyp", "p3.2xlarge"),
     ["nodeGroups[0].instanceTyp", "did you mean 'instanceType'"]),
    ("unknown market", "dev", lambda v: _group(v)["market"].__setitem__("type", "spott"),
     ["nodeGroups[0].market.type", "did you mean 'spot'"]),
    ("zone of another region", "dev", lambda v: v[key("networks")][0]["subnets"][0].__setitem__("zone", "us-west-2a"),
     ["networks[0].subnets[0].zone", "not a zone of us-east-1"]),
    ("unsatisfiable requirement", "dev", lambda v: _group(v).__setitem__("gpu", {"model": "T4", "count": 2}),
     ["nodeGroups[0].gpu", "RAM >= 1.5 x GPU memory"]),
    ("Volta on AWS VMs", "dev", lambda v: _group(v).__setitem__("gpu", {"model": "V100", "count": 1}),
     ["nodeGroups[0].gpu.model", "V100 on AWS VMs", "R580"]),
    ("network without egress", "dev", lambda v: v[key("networks")][0].__setitem__("nat", False),
     ["networks[0].nat", "aws-train need egress", "set nat: true"]),
    ("ssh open to the world", "dev", lambda v: v[key("networks")][0].__setitem__("sshCidrs", ["0.0.0.0/0"]),
     ["networks[0].sshCidrs[0]", "0.0.0.0/0"]),
    ("training type short of RAM", "dev", lambda v: _group(v).update(gpu=None, instanceType="g5.xlarge"),
     ["nodeGroups[0].instanceType", "16 GiB RAM for 24 GB of GPU memory"]),
    ("unknown network", "dev", lambda v: _group(v).__setitem__("network", "aws-trian"),
     ["nodeGroups[0].network", "did you mean 'aws-train'"]),
    ("bad name", "dev", lambda v: _group(v).__setitem__("name", "Aws_Train"),
     ["nodeGroups[0].name", "lowercase letters, digits and hyphens"]),
    ("tencent schedule hour step", "dev", lambda v: _group(v, 2)["schedule"][0].__setitem__("cron", "0 */2 * * *"),
     ["nodeGroups[2].schedule[0].cron", "single hour value", "Beijing time"]),
    ("unknown top-level key", "dev", lambda v: v.__setitem__(key("budgte"), {}),
     ["budgte", "did you mean 'budget'"]),
]


@pytest.mark.parametrize("stack,edit,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_key(stack: str, edit: Edit, expected: list[str]) -> None:
    message = _parse(stack, edit)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert "Traceback" not in message


def test_all_problems_reported_at_once() -> None:
    def edit(v: dict[str, Any]) -> None:
        v[key("budget")]["monthlyLimitUsd"] = -5
        v[key("training")]["checkpointEvery"] = -1
    message = _parse("dev", edit)
    assert "budget.monthlyLimitUsd" in message and "training.checkpointEvery" in message
    assert message.startswith("2 problem(s) in Pulumi.dev.yaml")


def test_requirement_selects_cheapest_fitting_type() -> None:
    stack = resolve(parse(spec_raw(stack_values("dev"))))
    types = stack.groups[0].types
    # 1 x T4: g4dn.xlarge has 16 GiB for 16 GB of GPU memory, under the 1.5x rule; g4dn.2xlarge fits.
    assert types[0] == "g4dn.2xlarge" and "g4dn.xlarge" not in types
    ali = stack.groups[1].types
    # gn7i-c8g1.2xlarge (30 GiB for a 24 GB A10) breaks the 1.5x RAM rule; the 16-vCPU one fits.
    assert ali[0] == "ecs.gn7i-c16g1.4xlarge" and "ecs.gn7i-c8g1.2xlarge" not in ali
