"""The AWS side of the shipped stacks, checked on what the program registers in the mock engine."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from infra.plan.engine import Registered
from tests.harness import by_type, key, policy_hits, run_stack, shipped

REQUIRED_TAGS = {"owner", "cost-center", "env"}


def _stack(stack: str) -> tuple[Registered, ...]:
    return shipped(stack)


def aws(stack: str) -> list[Registered]:
    return [r for r in _stack(stack) if r.type.startswith("aws:")]


def test_dev_aws_gpu_capacity_is_all_spot() -> None:
    assert by_type(aws("dev"), "aws:autoscaling/group:Group"), "dev has an AWS fleet"
    assert policy_hits(aws("dev"), "gpu-spot-only") == []


def test_spot_check_fails_when_a_dev_group_goes_on_demand(tmp_path: Path) -> None:
    def edit(v: dict[str, Any]) -> None:
        v[key("nodeGroups")][0]["market"] = {"type": "on-demand"}
    assert policy_hits(run_stack("dev", edit, tmp_path), "gpu-spot-only") == ["aws-train-asg"]


def test_prod_has_on_demand_base_and_spot_burst() -> None:
    asg = by_type(aws("prod"), "aws:autoscaling/group:Group")[0]
    policy = asg.inputs["mixedInstancesPolicy"]
    dist = policy["instancesDistribution"]
    assert dist["onDemandBaseCapacity"] == 1 and dist["onDemandPercentageAboveBaseCapacity"] == 0
    assert dist["spotAllocationStrategy"] == "price-capacity-optimized"
    assert asg.inputs["capacityRebalance"] is True
    types = [o["instanceType"] for o in policy["launchTemplate"]["overrides"]]
    assert types == ["p4d.24xlarge", "p4de.24xlarge"]
    assert asg.inputs["placementGroup"], "multi-node training gets a cluster placement group"
    capacity = {ng.name: ng.inputs["capacityType"] for ng in by_type(aws("prod"), "aws:eks/nodeGroup:NodeGroup")}
    assert capacity["aws-eks-train-od"] == "ON_DEMAND" and capacity["aws-eks-train-spot"] == "SPOT"


def test_no_ingress_from_anywhere() -> None:
    for stack in ("dev", "prod"):
        assert by_type(aws(stack), "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
        assert policy_hits(aws(stack), "no-public-ingress") == []
        for sg in by_type(aws(stack), "aws:ec2/securityGroup:SecurityGroup"):
            assert not sg.inputs.get("ingress"), "rules are separate resources"


def test_imdsv2_required_on_every_launch_template() -> None:
    lts = by_type(aws("prod"), "aws:ec2/launchTemplate:LaunchTemplate")
    assert len(lts) == 4  # the VM fleet, both EKS GPU groups and the EKS system group
    for lt in lts:
        assert lt.inputs["metadataOptions"]["httpTokens"] == "required", lt.name
        for bdm in lt.inputs["blockDeviceMappings"]:
            assert bdm["ebs"]["encrypted"] == "true"


def test_peering_routes_on_both_sides() -> None:
    res = aws("prod")
    vpc_of_table = {f"{t.name}-id": t.inputs["vpcId"] for t in by_type(res, "aws:ec2/routeTable:RouteTable")}
    peerings = by_type(res, "aws:ec2/vpcPeeringConnection:VpcPeeringConnection")
    assert len(peerings) == 2
    for pcx in peerings:
        routes = [r for r in by_type(res, "aws:ec2/route:Route")
                  if r.inputs.get("vpcPeeringConnectionId") == f"{pcx.name}-id"]
        vpcs = {vpc_of_table[r.inputs["routeTableId"]] for r in routes}
        assert vpcs == {pcx.inputs["vpcId"], pcx.inputs["peerVpcId"]}, pcx.name
    cross = next(p for p in peerings if p.inputs.get("peerRegion"))
    assert cross.inputs["peerRegion"] == "us-west-2"
    assert by_type(res, "aws:ec2/vpcPeeringConnectionAccepter:VpcPeeringConnectionAccepter")


def test_bucket_versioned_encrypted_private_with_lifecycle() -> None:
    res = aws("prod")
    (bucket,) = by_type(res, "aws:s3/bucket:Bucket")
    name = bucket.inputs["bucket"]
    (ver,) = by_type(res, "aws:s3/bucketVersioning:BucketVersioning")
    assert ver.inputs["bucket"] == name and ver.inputs["versioningConfiguration"]["status"] == "Enabled"
    (sse,) = by_type(res, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")
    assert sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"
    (pab,) = by_type(res, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")
    assert all(pab.inputs[k] is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                                "restrictPublicBuckets"))
    (life,) = by_type(res, "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    rules = {r["id"]: r for r in life.inputs["rules"]}
    assert rules["checkpoints-to-glacier-ir"]["transitions"][0] == {"days": 30, "storageClass": "GLACIER_IR"}
    assert rules["expire-noncurrent"]["noncurrentVersionExpiration"]["noncurrentDays"] == 30
    assert rules["abort-multipart"]["abortIncompleteMultipartUpload"]["daysAfterInitiation"] == 7
    (policy,) = by_type(res, "aws:s3/bucketPolicy:BucketPolicy")
    assert "aws:SecureTransport" in policy.inputs["policy"]


def _taggable(type_token: str) -> bool:
    _, module, name = type_token.split(":")
    cls = getattr(importlib.import_module(f"pulumi_aws.{module.split('/')[0]}"), name)
    return "tags" in inspect.signature(cls._internal_init).parameters


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_taggable_resource_is_tagged(stack: str) -> None:
    checked = 0
    for r in aws(stack):
        if r.type == "aws:autoscaling/group:Group":
            assert REQUIRED_TAGS <= {t["key"] for t in r.inputs["tags"]}
            continue
        if _taggable(r.type):
            checked += 1
            assert REQUIRED_TAGS <= set(r.inputs.get("tags", {})), f"{r.type} {r.name} is untagged"
    assert checked > 10


def test_training_job_and_device_plugin_on_eks() -> None:
    res = list(_stack("prod"))
    (job,) = [j for j in by_type(res, "kubernetes:batch/v1:Job") if j.name == "aws-eks-train-job"]
    spec = job.inputs["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure" and spec["backoffLimit"] == 6
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"  # p5.48xlarge
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CHECKPOINT_URL"] == "s3://gts-prod-us-east-1/checkpoints/aws-eks-train/"
    # What the pod reports for the budget-pace alert: its group's node price, disk included.
    from infra.resolve.groups import resolve
    from infra.stack.stackfile import load_stack_spec

    group = resolve(load_stack_spec("prod")).group("aws-eks-train")
    assert env["NODE_HOURLY_USD"] == f"{group.node_hourly_usd:.4f}" and float(env["NODE_HOURLY_USD"]) > 0
    assert env["GTS_CLOUD"] == "aws" and env["GTS_NODE_GROUP"] == "aws-eks-train"
    assert by_type(res, "kubernetes:apps/v1:DaemonSet")
    (cluster,) = by_type(res, "aws:eks/cluster:Cluster")
    # Public only to the operators' CIDRs (kubernetes.apiAccessCidrs), private endpoint on.
    assert cluster.inputs["vpcConfig"]["publicAccessCidrs"] == ["203.0.113.0/24"]
    assert cluster.inputs["vpcConfig"]["endpointPrivateAccess"] is True
    assert cluster.inputs["encryptionConfig"]["resources"] == ["secrets"]
    gpu_groups = [ng for ng in by_type(res, "aws:eks/nodeGroup:NodeGroup") if not ng.name.endswith("-system")]
    assert len(gpu_groups) == 3
    for ng in gpu_groups:
        assert ng.inputs["amiType"] == "AL2023_x86_64_NVIDIA"
        assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"} in ng.inputs["taints"]


def test_budget_and_schedule() -> None:
    res = aws("prod")
    (budget,) = by_type(res, "aws:budgets/budget:Budget")
    assert budget.inputs["limitAmount"] == "250000.00" and budget.inputs["timeUnit"] == "MONTHLY"
    kinds = {n["notificationType"] for n in budget.inputs["notifications"]}
    assert kinds == {"ACTUAL", "FORECASTED"}
    schedules = {s.name: s.inputs for s in by_type(res, "aws:autoscaling/schedule:Schedule")}
    assert schedules["aws-train-weekend-down"]["recurrence"] == "0 0 * * 6"
    assert schedules["aws-train-weekend-down"]["desiredCapacity"] == 1


def test_done_when_counts() -> None:
    res = aws("prod")
    assert len(by_type(res, "aws:ec2/vpc:Vpc")) >= 2
    assert by_type(res, "aws:ec2/vpcEndpoint:VpcEndpoint"), "S3 gateway endpoint"
    assert by_type(res, "aws:ec2/natGateway:NatGateway")
    # dev nodes need egress too (no public addresses): every network with nodes has a NAT.
    assert len(by_type(aws("dev"), "aws:ec2/natGateway:NatGateway")) == 1
    (lt,) = [t for t in by_type(res, "aws:ec2/launchTemplate:LaunchTemplate") if t.name == "aws-train-lt"]
    assert lt.inputs["userData"]
