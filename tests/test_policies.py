"""Policy rules: compliant, violating and property-missing cases on all three clouds' types,
the shipped stacks, and the plan's exit code on violations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT
from policies.gts_policy import rules, rules_cost, rules_security
from policies.gts_policy.resources import Res
from tests.harness import key, project_copy, stack_values, write_stack

TAGS = {"owner": "o", "cost-center": "c", "env": "dev"}


def _names(check: Any, resources: list[Res], cfg: dict[str, Any] | None = None) -> list[str]:
    """Names a rule reports, for a stack rule's function or a resource rule's."""
    rule = next(r for r in rules.RULES if check in (r.check, r.per_resource))
    return [name for name, _ in rule.run(resources, cfg or {})]


# GPU capacity on each cloud, spot or not: (spot resource list, on-demand resource list)
def aws_asg(spot: bool, itype: str = "p3.2xlarge", max_size: int = 2, workload: str = "training") -> list[Res]:
    lt = Res("aws:ec2/launchTemplate:LaunchTemplate", "lt", {"metadataOptions": {"httpTokens": "required"},
             "blockDeviceMappings": [{"ebs": {"volumeSize": 1000, "encrypted": "true"}}], "tags": TAGS})
    asg = Res("aws:autoscaling/group:Group", "asg", {"maxSize": max_size, "minSize": 1, "tags": [
        {"key": "gpu-training-stack/workload", "value": workload}], "mixedInstancesPolicy": {
        "instancesDistribution": {"onDemandBaseCapacity": 0 if spot else 1,
                                  "onDemandPercentageAboveBaseCapacity": 0 if spot else 100},
        "launchTemplate": {"launchTemplateSpecification": {"launchTemplateId": "lt-id"},
                           "overrides": [{"instanceType": itype}]}}})
    return [lt, asg]


def ali_pool(spot: bool, itype: str = "ecs.gn6v-c8g1.2xlarge", workload: str = "training") -> list[Res]:
    return [Res("alicloud:cs/nodePool:NodePool", "pool", {
        "instanceTypes": [itype], "spotStrategy": "SpotAsPriceGo" if spot else "NoSpot",
        "scalingConfig": {"minSize": 1, "maxSize": 2}, "dataDisks": [{"size": 1000, "encrypted": True}],
        "labels": {"gpu-training-stack/workload": workload}, "tags": TAGS})]


def tc_instance(spot: bool, itype: str = "GN10X.2XLARGE40", workload: str = "training") -> list[Res]:
    return [Res("tencentcloud:Instance/instance:Instance", "cvm", {
        "instanceType": itype, "instanceChargeType": "SPOTPAID" if spot else "POSTPAID_BY_HOUR",
        "dataDisks": [{"dataDiskSize": 1000, "encrypt": True}],
        "tags": {**TAGS, "gpu-training-stack/workload": workload}})]


CLOUDS: dict[str, Callable[..., list[Res]]] = {"aws": aws_asg, "alicloud": ali_pool, "tencentcloud": tc_instance}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_spot_only(cloud: str) -> None:
    make = CLOUDS[cloud]
    assert _names(rules_cost.spot_only, make(True)) == []
    assert len(_names(rules_cost.spot_only, make(False))) == 1
    # Missing market properties read as on-demand: the rule does not let them pass.
    bare = [Res(r.type, r.name, {k: v for k, v in r.props.items()
                                 if k not in ("spotStrategy", "instanceChargeType")}) for r in make(True)]
    if cloud != "aws":
        assert len(_names(rules_cost.spot_only, bare)) == 1


@pytest.mark.parametrize("cloud,bad_type,good_type", [
    ("aws", "g5.xlarge", "p3.2xlarge"),
    ("alicloud", "ecs.gn7i-c8g1.2xlarge", "ecs.gn7i-c16g1.4xlarge"),
    ("tencentcloud", "GN10Xp.20XLARGE320", "GT4.41XLARGE948")])
def test_host_ram_ratio(cloud: str, bad_type: str, good_type: str) -> None:
    make = CLOUDS[cloud]
    assert _names(rules_cost.host_ram, make(True, itype=good_type)) == []
    assert len(_names(rules_cost.host_ram, make(True, itype=bad_type))) == 1
    # Inference groups are exempt; the inference-class advisory looks at them instead.
    assert _names(rules_cost.host_ram, make(True, itype=bad_type, workload="inference")) == []


@pytest.mark.parametrize("cloud", CLOUDS)
def test_dataset_disk_gpu_memory_families_max_nodes(cloud: str) -> None:
    res = CLOUDS[cloud](True)
    assert _names(rules_cost.dataset_disk, res, {"minGb": 1000}) == []
    assert len(_names(rules_cost.dataset_disk, res, {"minGb": 2000})) == 1
    assert _names(rules_cost.gpu_memory, res, {"minGpuMemoryGb": 16}) == []
    assert len(_names(rules_cost.gpu_memory, res, {"minGpuMemoryGb": 32})) == 1  # 16 GB V100s
    assert _names(rules_cost.allowed_families, res, {}) == []
    assert len(_names(rules_cost.allowed_families, res, {"families": ["p5"]})) == 1
    assert len(_names(rules_cost.max_nodes, res, {"maxNodesPerGroup": 0})) == 1
    assert _names(rules_cost.max_nodes, res, {"maxNodesPerGroup": 2}) == []


def test_cost_caps_use_catalog_prices() -> None:
    res = aws_asg(True, itype="p4d.24xlarge", max_size=4)  # 4 x 21.957642 = 87.83 USD/h
    assert _names(rules_cost.stack_cost_cap, res, {"maxHourlyUsd": 88}) == []
    assert _names(rules_cost.stack_cost_cap, res, {"maxHourlyUsd": 87}) == ["stack"]
    assert _names(rules_cost.stack_cost_cap, res, {"maxMonthlyUsd": 87.83 * 730 - 1}) == ["stack"]
    assert _names(rules_cost.group_cost_cap, res, {"maxHourlyUsdPerGroup": 50}) == ["asg"]
    tc = tc_instance(True, itype="GT4.41XLARGE948")  # 253.84 CNY / 7.2
    assert _names(rules_cost.stack_cost_cap, tc, {"maxHourlyUsd": 35, "cnyPerUsd": 7.2}) == ["stack"]
    assert _names(rules_cost.stack_cost_cap, tc, {"maxHourlyUsd": 36, "cnyPerUsd": 7.2}) == []


def test_inference_class_and_reserve_advisories() -> None:
    assert len(_names(rules_cost.inference_class, aws_asg(True, itype="p4d.24xlarge", workload="inference"))) == 1
    assert _names(rules_cost.inference_class, aws_asg(True, itype="g6.12xlarge", workload="inference")) == []
    assert len(_names(rules_cost.reserve_always_on, aws_asg(False))) == 1
    assert _names(rules_cost.reserve_always_on, aws_asg(True)) == []


INGRESS: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "aws": ("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", lambda c: {"cidrIpv4": c}),
    "alicloud": ("alicloud:ecs/securityGroupRule:SecurityGroupRule", lambda c: {"type": "ingress", "cidrIp": c}),
    "tencentcloud": ("tencentcloud:Security/groupRuleSet:GroupRuleSet",
                     lambda c: {"ingresses": [{"cidrBlock": c, "action": "ACCEPT"}]}),
}


@pytest.mark.parametrize("cloud", INGRESS)
def test_no_public_ingress(cloud: str) -> None:
    kind, props = INGRESS[cloud]
    assert _names(rules_security.no_public_ingress, [Res(kind, "r", props("203.0.113.0/24"))]) == []
    assert _names(rules_security.no_public_ingress, [Res(kind, "r", props("0.0.0.0/0"))]) == ["r"]
    assert _names(rules_security.no_public_ingress, [Res(kind, "r", {})]) == []  # no CIDR: nothing admitted


@pytest.mark.parametrize("kind,good,bad", [
    ("aws:ec2/launchTemplate:LaunchTemplate", {"metadataOptions": {"httpTokens": "required"}},
     {"metadataOptions": {"httpTokens": "optional"}}),
    ("alicloud:ecs/instance:Instance", {"httpTokens": "required"}, {"httpTokens": "optional"})])
def test_metadata_hardened(kind: str, good: dict[str, Any], bad: dict[str, Any]) -> None:
    assert _names(rules_security.metadata_hardened, [Res(kind, "r", good)]) == []
    assert _names(rules_security.metadata_hardened, [Res(kind, "r", bad)]) == ["r"]
    assert _names(rules_security.metadata_hardened, [Res(kind, "r", {})]) == ["r"]  # missing = not hardened


@pytest.mark.parametrize("kind,props", [
    ("alicloud:ecs/instance:Instance", {"password": "x"}),
    ("tencentcloud:Kubernetes/nodePool:NodePool", {"autoScalingConfig": {"password": "x"}}),
    ("tencentcloud:Instance/instance:Instance", {"password": "x"})])
def test_no_passwords(kind: str, props: dict[str, Any]) -> None:
    assert _names(rules_security.no_passwords, [Res(kind, "r", props)]) == ["r"]
    assert _names(rules_security.no_passwords, [Res(kind, "r", {})]) == []


def test_buckets_on_all_clouds() -> None:
    bucket = Res("aws:s3/bucket:Bucket", "b", {"bucket": "bk"})
    extras = [Res("aws:s3/bucketVersioning:BucketVersioning", "v", {"bucket": "bk", "versioningConfiguration": {"status": "Enabled"}}),
              Res("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", "e",
                  {"bucket": "bk", "rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "aws:kms"}}]}),
              Res("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", "p", {"bucket": "bk", **{
                  k: True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")}})]
    assert _names(rules_security.buckets_safe, [bucket, *extras]) == []
    assert _names(rules_security.buckets_safe, [bucket, *extras[1:]]) == ["b"]  # not versioned
    assert _names(rules_security.buckets_safe, [bucket]) == ["b"]
    oss = {"versioning": {"status": "Enabled"}, "serverSideEncryptionRule": {"sseAlgorithm": "KMS"}}
    assert _names(rules_security.buckets_safe, [Res("alicloud:oss/bucket:Bucket", "o", oss)]) == []
    assert _names(rules_security.buckets_safe, [Res("alicloud:oss/bucket:Bucket", "o", {**oss, "acl": "public-read"})]) == ["o"]
    assert _names(rules_security.buckets_safe, [Res("alicloud:oss/bucket:Bucket", "o", {})]) == ["o"]
    cos = {"acl": "private", "versioningEnable": True, "encryptionAlgorithm": "AES256"}
    assert _names(rules_security.buckets_safe, [Res("tencentcloud:Cos/bucket:Bucket", "c", cos)]) == []
    assert _names(rules_security.buckets_safe, [Res("tencentcloud:Cos/bucket:Bucket", "c", {**cos, "versioningEnable": False})]) == ["c"]
    assert _names(rules_security.buckets_safe, [Res("tencentcloud:Cos/bucket:Bucket", "c", {})]) == ["c"]


@pytest.mark.parametrize("cloud", CLOUDS)
def test_disks_encrypted(cloud: str) -> None:
    good = CLOUDS[cloud](True)
    assert _names(rules_security.disks_encrypted, good) == []
    flipped = json.loads(json.dumps([r.props for r in good]).replace('"encrypted": "true"', '"encrypted": "false"')
                         .replace('"encrypted": true', '"encrypted": false').replace('"encrypt": true', '"encrypt": false'))
    bad = [Res(r.type, r.name, p) for r, p in zip(good, flipped)]
    assert len(_names(rules_security.disks_encrypted, bad)) == 1


@pytest.mark.parametrize("kind,public,private", [
    ("aws:eks/cluster:Cluster", {"vpcConfig": {"endpointPublicAccess": True}}, {"vpcConfig": {"endpointPublicAccess": False}}),
    ("alicloud:cs/managedKubernetes:ManagedKubernetes", {"slbInternetEnabled": True}, {"slbInternetEnabled": False}),
    ("tencentcloud:Kubernetes/cluster:Cluster", {"clusterInternet": True}, {"clusterInternet": False})])
def test_private_kubernetes_api(kind: str, public: dict[str, Any], private: dict[str, Any]) -> None:
    assert _names(rules_security.private_kubernetes_api, [Res(kind, "k", public)]) == ["k"]
    assert _names(rules_security.private_kubernetes_api, [Res(kind, "k", private)]) == []


@pytest.mark.parametrize("kind", ["aws:ec2/vpc:Vpc", "alicloud:vpc/network:Network", "tencentcloud:Vpc/instance:Instance"])
def test_required_tags(kind: str) -> None:
    assert _names(rules_security.required_tags, [Res(kind, "n", {"tags": TAGS})]) == []
    assert _names(rules_security.required_tags, [Res(kind, "n", {"tags": {"owner": "o"}})]) == ["n"]
    assert _names(rules_security.required_tags, [Res(kind, "n", {})]) == ["n"]
    assert _names(rules_security.required_tags, [Res("aws:iam/rolePolicyAttachment:RolePolicyAttachment", "a", {})]) == []


def _plan(stack_dir: Path, stack: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"],
                          cwd=stack_dir, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_shipped_stacks_have_no_mandatory_violation(stack: str) -> None:
    proc = _plan(ROOT, stack)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [v for v in plan["violations"] if v["enforcement"] == "mandatory"] == []


def test_dev_stack_turned_on_demand_fails_the_spot_rule(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    values = stack_values("dev")
    values[key("nodeGroups")][0]["market"] = {"type": "on-demand"}
    write_stack(proj, "dev", values)
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", "dev", "--format", "json"], cwd=proj,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})
    assert proc.returncode == 1, proc.stderr
    plan = json.loads(proc.stdout)
    spot = [v for v in plan["violations"] if v["policy"] == "gpu-spot-only"]
    assert spot and spot[0]["enforcement"] == "mandatory" and "aws-train" in spot[0]["message"]


def test_unknown_values_during_preview_are_not_a_pass() -> None:
    """In `pulumi preview` the policy SDK hands rules proxies that raise on unknown values;
    the SDK reports those as unknown. A rule must reach the value, not default around it."""
    from pulumi_policy.proxy import UnknownValueError, unknown_checking_proxy
    unknown = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"
    props = unknown_checking_proxy({"instanceType": "GN10X.2XLARGE40", "instanceChargeType": unknown, "tags": TAGS})
    with pytest.raises(UnknownValueError):
        rules_cost.spot_only([Res("tencentcloud:Instance/instance:Instance", "cvm", props)], {})
    known = unknown_checking_proxy({"tags": [{"key": k, "value": v} for k, v in TAGS.items()],
                                    "maxSize": 2, "mixedInstancesPolicy": {"instancesDistribution": {
                                        "onDemandBaseCapacity": 1, "onDemandPercentageAboveBaseCapacity": 100},
                                        "launchTemplate": {"overrides": [{"instanceType": "p3.2xlarge"}]}}})
    assert _names(rules_cost.spot_only, [Res("aws:autoscaling/group:Group", "asg", known)]) == ["asg"]
