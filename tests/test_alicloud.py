"""The Alibaba Cloud side of the shipped stacks, checked on what the program registers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.core import catalog as cat
from infra.plan.engine import Registered
from policies.gts_policy.resources import taggable
from tests.harness import by_type, key, policy_hits, run_stack, shipped

REQUIRED_TAGS = {"owner", "cost-center", "env"}
SPOT = {"SpotAsPriceGo", "SpotWithPriceLimit"}


def _stack(stack: str) -> tuple[Registered, ...]:
    return shipped(stack)


def ali(stack: str) -> list[Registered]:
    return [r for r in _stack(stack) if r.type.startswith("alicloud:")]


def test_dev_every_alibaba_gpu_resource_is_spot() -> None:
    assert by_type(ali("dev"), "alicloud:ess/scalingGroup:ScalingGroup")
    assert policy_hits(ali("dev"), "gpu-spot-only") == []


def test_spot_check_fails_for_on_demand_and_reserved(tmp_path: Path) -> None:
    def on_demand(v: dict[str, Any]) -> None:
        v[key("nodeGroups")][1]["market"] = {"type": "on-demand"}
    res = [r for r in run_stack("dev", on_demand, tmp_path) if r.cloud == "alicloud"]
    assert policy_hits(res, "gpu-spot-only") == ["ali-train-ess"]

    def reserved(v: dict[str, Any]) -> None:
        v[key("nodeGroups")][1].update(market={"type": "reserved"}, schedule=[])
    res = [r for r in run_stack("dev", reserved, tmp_path) if r.cloud == "alicloud"]
    instances = [i for i in by_type(res, "alicloud:ecs/instance:Instance") if "-rdzv-" not in i.name]
    assert len(instances) == 2  # scaling.max PrePaid instances (besides the on-demand rendezvous store)
    assert all(i.inputs["instanceChargeType"] == "PrePaid" and i.inputs["httpTokens"] == "required" for i in instances)
    assert not by_type(res, "alicloud:ess/scalingGroup:ScalingGroup")


def test_prod_on_demand_base_and_instance_type_pools() -> None:
    (group,) = by_type(ali("prod"), "alicloud:ess/scalingGroup:ScalingGroup")
    assert group.inputs["onDemandBaseCapacity"] == 1 and group.inputs["onDemandPercentageAboveBaseCapacity"] == 0
    assert group.inputs["spotInstanceRemedy"] is True and group.inputs["multiAzPolicy"] == "COST_OPTIMIZED"
    assert len(group.inputs["vswitchIds"]) == 2
    (pool,) = [p for p in by_type(ali("prod"), "alicloud:cs/nodePool:NodePool") if p.name == "ali-ack-train-pool"]
    catalog = cat.load_catalog()
    assert pool.inputs["instanceTypes"] and all(catalog.get("alicloud", t) for t in pool.inputs["instanceTypes"])
    assert pool.inputs["spotStrategy"] == "SpotAsPriceGo" and pool.inputs["onDemandBaseCapacity"] == "1"
    assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in pool.inputs["taints"]
    assert pool.inputs["instanceMetadataOptions"]["httpTokens"] == "required"


def test_a_requirement_with_several_types_gives_the_spot_pool_all_of_them(tmp_path: Path) -> None:
    """One A100 on Alibaba: the catalog has two types that pass the RAM rule (A100 40 GB and
    80 GB); the scaling group overrides list both, cheapest first, so spot has two pools."""
    def edit(v: dict[str, Any]) -> None:
        v[key("nodeGroups")][1]["gpu"] = {"model": "A100", "count": 1}
    res = [r for r in run_stack("dev", edit, tmp_path) if r.cloud == "alicloud"]
    (group,) = by_type(res, "alicloud:ess/scalingGroup:ScalingGroup")
    types = [o["instanceType"] for o in group.inputs["launchTemplateOverrides"]]
    catalog = cat.load_catalog()
    expected = sorted((t for t in catalog.of_cloud("alicloud") if t.gpu_model == "A100" and t.gpu_count == 1
                       and t.ram_ok), key=lambda t: t.price_ondemand)
    assert len(expected) == 2 and types == [t.instance_type for t in expected]


def test_no_ingress_from_anywhere_and_hardened_metadata() -> None:
    for stack in ("dev", "prod"):
        rules = by_type(ali(stack), "alicloud:ecs/securityGroupRule:SecurityGroupRule")
        assert [r for r in rules if r.inputs["type"] == "ingress"]
        assert policy_hits(ali(stack), "no-public-ingress") == []
        for lt in by_type(ali(stack), "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate"):
            assert lt.inputs["httpTokens"] == "required"
            assert lt.inputs["systemDisk"]["encrypted"] is True
            assert all(d["encrypted"] is True for d in lt.inputs.get("dataDisks", []))
            assert lt.inputs["userData"], "user data from the cloud-init renderer"


def test_peering_routes_both_ways_and_cross_region_bandwidth() -> None:
    res = ali("prod")
    # The mock engine gives each VPC's system route table the id vtb-<vpc name> (infra/clouds/alicloud/mocks.py).
    table_of = {f"vtb-{r.name}": f"{r.name}-id" for r in by_type(res, "alicloud:vpc/network:Network")}
    peerings = by_type(res, "alicloud:vpc/peerConnection:PeerConnection")
    assert len(peerings) == 2
    for pcx in peerings:
        routes = [r for r in by_type(res, "alicloud:vpc/routeEntry:RouteEntry") if r.inputs["nexthopId"] == f"{pcx.name}-id"]
        assert all(r.inputs["nexthopType"] == "VpcPeer" for r in routes)
        assert {table_of[r.inputs["routeTableId"]] for r in routes} == {pcx.inputs["vpcId"], pcx.inputs["acceptingVpcId"]}
    cross = next(p for p in peerings if p.inputs["acceptingRegionId"] == "cn-shanghai")
    assert cross.inputs["bandwidth"] == 1000


def test_bucket_private_encrypted_versioned_with_lifecycle() -> None:
    res = ali("prod")
    (bucket,) = by_type(res, "alicloud:oss/bucket:Bucket")
    assert bucket.inputs["versioning"]["status"] == "Enabled"
    assert bucket.inputs["serverSideEncryptionRule"]["sseAlgorithm"] == "KMS"
    rules = {r["id"]: r for r in bucket.inputs["lifecycleRules"]}
    classes = [t["storageClass"] for t in rules["checkpoints-to-archive"]["transitions"]]
    # A ZRS bucket keeps zone redundancy for Standard, IA and Archive only; ColdArchive objects
    # are stored LRS (OSS "Storage redundancy" / "Convert storage redundancy types").
    assert bucket.inputs["redundancyType"] == "ZRS" and classes == ["Archive"]
    assert rules["expire-noncurrent"]["noncurrentVersionExpirations"][0]["days"] == 30
    assert rules["abort-multipart"]["abortMultipartUploads"][0]["days"] == 7
    (acl,) = by_type(res, "alicloud:oss/bucketAcl:BucketAcl")
    assert acl.inputs["acl"] == "private"
    (block,) = by_type(res, "alicloud:oss/bucketPublicAccessBlock:BucketPublicAccessBlock")
    assert block.inputs["blockPublicAccess"] is True


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_taggable_resource_is_tagged(stack: str) -> None:
    checked = 0
    for r in ali(stack):
        if taggable(r.type):
            checked += 1
            assert REQUIRED_TAGS <= set(r.inputs.get("tags", {})), f"{r.type} {r.name} is untagged"
    assert checked >= 8


def test_done_when_counts_and_private_ack() -> None:
    res = ali("prod")
    assert len(by_type(res, "alicloud:vpc/network:Network")) >= 2
    (cluster,) = by_type(res, "alicloud:cs/managedKubernetes:ManagedKubernetes")
    assert cluster.inputs["slbInternetEnabled"] is False
    assert by_type(res, "alicloud:vpc/natGateway:NatGateway") and by_type(res, "alicloud:vpc/snatEntry:SnatEntry")
    jobs = [j for j in by_type(list(_stack("prod")), "kubernetes:batch/v1:Job") if j.name == "ali-ack-train-job"]
    (job,) = jobs
    env = {e["name"]: e.get("value") for e in job.inputs["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["CHECKPOINT_URL"] == "oss://gts-prod-cn-hangzhou/checkpoints/ali-ack-train/"
