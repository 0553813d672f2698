"""The Tencent Cloud side of the shipped stacks, checked on what the program registers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.core.schedule import cron_in_beijing, recurrence_window
from infra.plan.engine import Registered
from policies.gts_policy.resources import taggable
from tests.harness import by_type, key, run_stack, shipped

REQUIRED_TAGS = {"owner", "cost-center", "env"}


def _stack(stack: str) -> tuple[Registered, ...]:
    return shipped(stack)


def tc(stack: str) -> list[Registered]:
    return [r for r in _stack(stack) if r.type.startswith("tencentcloud:")]


def charge_types(resources: list[Registered]) -> dict[str, str]:
    out = {r.name: r.inputs["instanceChargeType"] for r in resources
           if r.type in ("tencentcloud:Instance/instance:Instance", "tencentcloud:As/scalingConfig:ScalingConfig")
           and "-rdzv-" not in r.name}  # the rendezvous store: no GPU, on demand by design
    out |= {r.name: r.inputs["autoScalingConfig"]["instanceChargeType"]
            for r in by_type(resources, "tencentcloud:Kubernetes/nodePool:NodePool")}
    return out


def test_dev_every_tencent_gpu_resource_is_spotpaid() -> None:
    charges = charge_types(tc("dev"))
    assert charges and set(charges.values()) == {"SPOTPAID"}
    (config,) = by_type(tc("dev"), "tencentcloud:As/scalingConfig:ScalingConfig")
    assert config.inputs["spotInstanceType"] == "one-time"
    assert config.inputs["spotMaxPrice"] == f"{1.5 * 7.2:.4f}"  # spotMaxPriceUsd in CNY


def test_prod_on_demand_base_with_spot_burst() -> None:
    charges = charge_types(tc("prod"))
    assert charges["tc-train-0"] == "POSTPAID_BY_HOUR" and charges["tc-train-config"] == "SPOTPAID"
    assert charges["tc-tke-train-od"] == "POSTPAID_BY_HOUR" and charges["tc-tke-train-spot"] == "SPOTPAID"
    (group,) = by_type(tc("prod"), "tencentcloud:As/scalingGroup:ScalingGroup")
    assert (group.inputs["minSize"], group.inputs["maxSize"]) == (0, 3)  # 1..4 minus the base node
    (instance,) = [i for i in by_type(tc("prod"), "tencentcloud:Instance/instance:Instance") if "-rdzv-" not in i.name]
    assert instance.inputs["dataDisks"][0]["encrypt"] is True and instance.inputs["dataDisks"][0]["dataDiskType"] == "CLOUD_HSSD"
    assert instance.inputs["userData"]


def test_tke_pools_are_gpu_pools() -> None:
    pools = [p for p in by_type(tc("prod"), "tencentcloud:Kubernetes/nodePool:NodePool") if p.name.startswith("tc-tke")]
    assert len(pools) == 2
    for pool in pools:
        assert pool.inputs["autoScalingConfig"]["instanceType"] == "GN10X.18XLARGE320"
        assert pool.inputs["nodeConfig"]["gpuArgs"]["driver"]["version"]
        assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in pool.inputs["taints"]
        assert all(d["encrypt"] is True for d in pool.inputs["autoScalingConfig"]["dataDisks"])
    (cluster,) = by_type(tc("prod"), "tencentcloud:Kubernetes/cluster:Cluster")
    assert "clusterInternet" not in cluster.inputs and "clusterIntranet" not in cluster.inputs


def test_no_ingress_from_anywhere() -> None:
    for stack in ("dev", "prod"):
        sets = by_type(tc(stack), "tencentcloud:Security/groupRuleSet:GroupRuleSet")
        assert sets
        for rule_set in sets:
            assert all(i.get("cidrBlock") != "0.0.0.0/0" for i in rule_set.inputs["ingresses"])


def test_peering_routes_both_ways() -> None:
    res = tc("prod")
    vpc_of_table = {f"{t.name}-id": t.inputs["vpcId"] for t in by_type(res, "tencentcloud:Route/table:Table")}
    peerings = by_type(res, "tencentcloud:Vpc/peerConnectManager:PeerConnectManager")
    assert len(peerings) == 2
    for pcx in peerings:
        routes = [r for r in by_type(res, "tencentcloud:Route/tableEntry:TableEntry") if r.inputs["nextHub"] == f"{pcx.name}-id"]
        assert all(r.inputs["nextType"] == "PEERCONNECTION" for r in routes)
        assert {vpc_of_table[r.inputs["routeTableId"]] for r in routes} == {pcx.inputs["sourceVpcId"],
                                                                             pcx.inputs["destinationVpcId"]}
        assert pcx.inputs["destinationUin"] == "100000000001"
    cross = next(p for p in peerings if p.inputs["destinationRegion"] == "ap-shanghai")
    assert cross.inputs["bandwidth"] == 1000


def test_transit_links_use_ccn(tmp_path: Path) -> None:
    def edit(v: dict[str, Any]) -> None:
        for p in v[key("peerings")]:
            if p["name"] == "tc-gz-sh":
                p["via"] = "transit"
    res = [r for r in run_stack("prod", edit, tmp_path) if r.cloud == "tencentcloud"]
    assert len(by_type(res, "tencentcloud:Ccn/instance:Instance")) == 1
    attached = {a.inputs["instanceRegion"] for a in by_type(res, "tencentcloud:Ccn/attachmentV2:AttachmentV2")}
    assert attached == {"ap-guangzhou", "ap-shanghai"}
    assert len(by_type(res, "tencentcloud:Vpc/peerConnectManager:PeerConnectManager")) == 1


def test_bucket_private_encrypted_versioned_with_lifecycle() -> None:
    (bucket,) = by_type(tc("prod"), "tencentcloud:Cos/bucket:Bucket")
    assert bucket.inputs["bucket"] == "gts-prod-ap-guangzhou-1250000000"
    assert bucket.inputs["acl"] == "private" and bucket.inputs["versioningEnable"] is True
    assert bucket.inputs["encryptionAlgorithm"] == "AES256"
    rules = {r["id"]: r for r in bucket.inputs["lifecycleRules"]}
    assert [t["storageClass"] for t in rules["checkpoints-to-archive"]["transitions"]] == ["ARCHIVE", "DEEP_ARCHIVE"]
    assert rules["expire-noncurrent"]["nonCurrentExpiration"]["nonCurrentDays"] == 30
    assert rules["abort-multipart"]["abortIncompleteMultipartUpload"]["daysAfterInitiation"] == 7


def test_budget_in_cny_with_alerts() -> None:
    (budget,) = by_type(tc("prod"), "tencentcloud:Billing/budget:Budget")
    assert budget.inputs["budgetQuota"] == f"{250000 * 7.2:.2f}" and budget.inputs["cycleType"] == "MONTH"
    warns = {(w["warnType"], w["thresholdValue"]) for w in budget.inputs["warnJsons"]}
    assert ("ACTUAL", "120") in warns and ("FORECAST", "100") in warns


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_taggable_resource_is_tagged(stack: str) -> None:
    checked = 0
    for r in tc(stack):
        if taggable(r.type):
            checked += 1
            assert REQUIRED_TAGS <= set(r.inputs.get("tags", {})), f"{r.type} {r.name} is untagged"
    assert checked >= 8


def test_international_site_cannot_buy_spot(tmp_path: Path) -> None:
    def edit(v: dict[str, Any]) -> None:
        v[key("clouds")]["tencentcloud"]["site"] = "international"
    with pytest.raises(pulumi.RunError, match=r"nodeGroups\[2\].market.type.*international-site Tencent Cloud"):
        run_stack("dev", edit, tmp_path)


def test_cron_to_beijing_time() -> None:
    assert cron_in_beijing("0 12 * * 1-5") == "0 20 * * 1-5"
    assert cron_in_beijing("30 20 * * 1-5") == "30 4 * * 2,3,4,5,6"
    assert cron_in_beijing("0 18 * * 6") == "0 2 * * 0"
    assert cron_in_beijing("0 20 * * *") == "0 4 * * *"
    with pytest.raises(ValueError, match="single hour"):
        cron_in_beijing("0 */2 * * *")


def test_recurrence_window_starts_next_full_hour_in_the_clouds_zone() -> None:
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 11, 29, 15, 42, 7, tzinfo=timezone.utc)
    start, end = recurrence_window(timezone(timedelta(hours=8)), now)
    assert start.isoformat() == "2026-11-30T00:00:00+08:00"
    # The end: first of the month eleven months on, the same all month, within the 365 days
    # Alibaba allows from creation.
    assert end.isoformat() == "2027-10-01T00:00:00+08:00"
    assert recurrence_window(now=now)[0].isoformat() == "2026-11-29T16:00:00+00:00"
    for day in (1, 15, 30):
        created = datetime(2026, 11, day, 0, 30, tzinfo=timezone.utc)
        assert recurrence_window(now=created)[1] == datetime(2027, 10, 1, tzinfo=timezone.utc)
        assert (recurrence_window(now=created)[1] - created).days < 365
    assert recurrence_window(now=datetime(2026, 12, 1, tzinfo=timezone.utc))[1] == datetime(2027, 11, 1, tzinfo=timezone.utc)


def test_done_when_counts() -> None:
    res = tc("prod")
    assert len(by_type(res, "tencentcloud:Vpc/instance:Instance")) >= 2
    assert by_type(res, "tencentcloud:Kubernetes/cluster:Cluster") and by_type(res, "tencentcloud:Cos/bucket:Bucket")
    assert by_type(res, "tencentcloud:Billing/budget:Budget")
    jobs = [j for j in by_type(list(_stack("prod")), "kubernetes:batch/v1:Job") if j.name == "tc-tke-train-job"]
    assert len(jobs) == 1
