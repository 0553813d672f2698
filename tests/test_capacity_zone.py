"""A zone candidate (issue 43): another zone of the group's own region, accepted when the group's
network has a subnet there; at it (activeCandidate) the group's fleet is declared with that zone's
subnets only — the AWS Auto Scaling group's vpc_zone_identifiers, the Alibaba ESS group's
vswitch_ids, the Tencent AS group's subnet_ids, read from the mock engine's resource inputs — and
the broker, given an Auto Scaling group short of capacity in zone a and stock in zone b, moves the
group there through the stack's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest

from infra.buckets import bucket
from infra.capacity.broker import Broker
from infra.capacity.workspace import RecordingWorkspace
from infra.checks.validation import parse_stack
from infra.core.errors import SpecError
from infra.resolve.cost import stack_cost
from tests.capacity_helpers import recorded
from tests.fabric_helpers import fabric_values
from tests.harness import key, run_stack, spec_raw, stack_values
from tests.test_capacity_broker import World
from tests.training_helpers import MotoServer, storage_env
from training.ckpt.storage import location

# group index -> (its network's index, the zone added to it, its cidr), in the dev stack
SECOND_ZONE = {0: (0, "us-east-1b", "10.10.16.0/20"), 1: (1, "cn-hangzhou-i", "10.40.16.0/20"),
               2: (2, "ap-guangzhou-4", "10.70.16.0/20")}
FLEETS = {0: ("aws:autoscaling/group:Group", "aws-train-asg", "vpcZoneIdentifiers"),
          1: ("alicloud:ess/scalingGroup:ScalingGroup", "ali-train-ess", "vswitchIds"),
          2: ("tencentcloud:As/scalingGroup:ScalingGroup", "tc-train-asg", "subnetIds")}


def _zone_candidate(config: dict[str, Any], group: int, active: int = 0, subnet: bool = True) -> None:
    """Group `group` of the dev stack with its network in a second zone and that zone as its candidate."""
    net, zone, cidr = SECOND_ZONE[group]
    if subnet:
        config[key("networks")][net]["subnets"].append({"zone": zone, "cidr": cidr})
    config[key("nodeGroups")][group]["capacity"] = [{"zone": zone}]
    config[key("nodeGroups")][group]["activeCandidate"] = active


def _fleet_subnets(group: int, active: int, tmp: Path) -> list[str]:
    kind, name, field = FLEETS[group]
    found = [r for r in run_stack("dev", lambda c: _zone_candidate(c, group, active), tmp)
             if r.type.lower() == kind.lower() and r.name == name]
    assert len(found) == 1, f"no {kind} {name}"
    return list(found[0].inputs[field])


# As declared: every subnet of the network, except that the AWS group (multi-node training, a
# cluster placement group) keeps to its first; at the candidate: that zone's subnet, placement or not.
@pytest.mark.parametrize(("group", "declared"), [
    (0, ["aws-train-private-us-east-1a-id"]),
    (1, ["ali-train-cn-hangzhou-h-id", "ali-train-cn-hangzhou-i-id"]),
    (2, ["tc-train-ap-guangzhou-3-id", "tc-train-ap-guangzhou-4-id"])], ids=["aws", "alicloud", "tencentcloud"])
def test_at_a_zone_candidate_the_fleet_has_that_zones_subnets_only(group: int, declared: list[str],
                                                                    tmp_path: Path) -> None:
    assert _fleet_subnets(group, 0, tmp_path) == declared
    moved = _fleet_subnets(group, 1, tmp_path)
    assert len(moved) == 1 and moved[0].endswith(f"-{SECOND_ZONE[group][1]}-id"), moved


def test_a_zone_without_a_subnet_of_the_groups_network_is_refused_by_name() -> None:
    config = stack_values("dev")
    _zone_candidate(config, 0, subnet=False)
    with pytest.raises(SpecError) as caught:
        parse_stack(spec_raw(config))
    assert [str(p) for p in caught.value.problems] == [
        "nodeGroups[0].capacity[0].zone: 'us-east-1b': the group's network 'aws-train' has no subnet in us-east-1b: "
        "add {zone: us-east-1b, cidr: ...} to networks[0].subnets, or remove the candidate"]


def test_a_zone_candidate_is_priced_at_its_regions_price_and_copies_nothing() -> None:
    config = stack_values("dev")
    _zone_candidate(config, 0)
    rows = stack_cost(parse_stack(spec_raw(config)))["capacity_places"]
    assert [(r["index"], r["place"]) for r in rows] == [(0, "aws us-east-1a g4dn.2xlarge spot"),
                                                        (1, "aws us-east-1b g4dn.2xlarge spot")]
    assert rows[0]["hourly_usd"] == rows[1]["hourly_usd"] and (rows[1]["move_gb"], rows[1]["move_usd"]) == (0.0, 0.0)


def test_the_broker_moves_a_group_short_in_zone_a_to_its_zone_b_candidate(
        moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    env = storage_env(moto.url)
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto.url, aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    zone_b = ec2.describe_availability_zones(ZoneNames=["us-east-1b"])["AvailabilityZones"][0]["ZoneId"]
    # zone a: the Auto Scaling group's InsufficientInstanceCapacity; zone b: a spot placement score of 9
    world = World(moto, monkeypatch, score=recorded("aws", "spot_placement_scores_high",
                                                    **{"us-west-2": "us-east-1", "usw2-az1": zone_b}))
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    moto.client().create_bucket(Bucket=bucket(spec, "aws").name)
    config = stack_values("dev")
    _zone_candidate(config, 0)
    config[key("nodeGroups")][0]["capacity"][0]["market"] = {"type": "spot"}
    config[key("nodeGroups")][0]["market"] = {"type": "on-demand"}  # the pack's cap: 1.5 x the declared $/h
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    workspace = RecordingWorkspace(values, {"aws": {"fleets": {"aws-train": [world.asg]}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    assert (decision.action, decision.at, decision.skipped) == ("move", 1, []), decision
    assert decision.reason.endswith("aws us-east-1b by gpu requirement spot: spot placement score 9 of 10 in us-east-1b")
    assert world.aws.calls == ["DescribeScalingActivities", "DescribeAutoScalingGroups", "DescribeInstanceTypeOfferings",
                               "GetServiceQuota", "DescribeAvailabilityZones", "GetSpotPlacementScores"]
    assert workspace.changes == [("gpu-training-stack:nodeGroups[0].activeCandidate", "1")]
    assert workspace.ups == ["capacity broker: aws-train to aws us-east-1b by gpu requirement spot"]
    # the stack's config names the zone candidate: the group is declared in zone b from now on
    (group, *_) = json.loads(workspace.values[key("nodeGroups")])
    assert group["capacity"][group["activeCandidate"] - 1]["zone"] == "us-east-1b"
    assert decision.copied is None  # one bucket per cloud: the nodes in zone b read the same checkpoints


def test_a_fabric_group_at_a_zone_candidate_keeps_one_zone_and_gets_its_own_hcc_there(tmp_path: Path) -> None:
    """The fabric groups of tests/fabric_helpers.py (prod): the AWS EFA group keeps one subnet and a
    cluster placement group, a new one for zone b; the Tencent HCC group's nodes and HCC move to the candidate zone."""
    def edit(values: dict[str, Any]) -> None:
        values.update(fabric_values())
        for group in values[key("nodeGroups")]:
            if group["name"] in ("aws-efa", "tc-hcc"):
                zone = "us-east-1b" if group["cloud"] == "aws" else "ap-guangzhou-4"
                group.update(capacity=[{"zone": zone}], activeCandidate=1)
    res = run_stack("prod", edit, tmp_path)
    (asg,) = [r for r in res if r.type == "aws:autoscaling/group:Group" and r.name == "aws-efa-asg"]
    assert asg.inputs["vpcZoneIdentifiers"] == ["aws-train-private-us-east-1b-id"] and asg.inputs["placementGroup"]
    # a cluster placement group is bound to its first instances' zone: a new one, named after zone b
    assert [r.name for r in res if r.type == "aws:ec2/placementGroup:PlacementGroup" and r.name.startswith(
        "aws-efa-")] == ["aws-efa-pg-us-east-1b"]
    (hcc,) = [r for r in res if r.type == "tencentcloud:Cvm/hpcCluster:HpcCluster"]
    assert (hcc.name, hcc.inputs["zone"]) == ("tc-hcc-hcc-ap-guangzhou-4", "ap-guangzhou-4")
    nodes = [r for r in res if r.type == "tencentcloud:Instance/instance:Instance" and r.name.startswith("tc-hcc-")]
    assert nodes and all((n.inputs["availabilityZone"], n.inputs["subnetId"]) == (
        "ap-guangzhou-4", "tc-train-ap-guangzhou-4-id") for n in nodes)


@pytest.mark.parametrize("move_back", [False, True], ids=["short-at-b", "move-back"])
def test_a_one_zone_group_at_its_zone_b_candidate_is_not_sent_back_to_zone_a_on_zone_bs_stock(
        move_back: bool, moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AWS dev group (multi-node training: one zone, its first subnet's) at its zone-b candidate,
    short there (or asked to move back): the declared place is zone a, asked as zone a, not the region
    (whose best zone is b, the one it is short in)."""
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto.url, aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    ids = {z["ZoneName"]: z["ZoneId"] for z in ec2.describe_availability_zones(
        ZoneNames=["us-east-1a", "us-east-1b"])["AvailabilityZones"]}
    scores: dict[str, object] = {"SpotPlacementScores": [
        {"Region": "us-east-1", "AvailabilityZoneId": ids["us-east-1a"], "Score": 1},
        {"Region": "us-east-1", "AvailabilityZoneId": ids["us-east-1b"], "Score": 9}]}
    world = World(moto, monkeypatch, short=not move_back, score=scores)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    s3, name = moto.client(), bucket(spec, "aws").name
    s3.create_bucket(Bucket=name)
    for found in s3.list_objects_v2(Bucket=name).get("Contents", []):  # the module's earlier moves' records
        s3.delete_object(Bucket=name, Key=found["Key"])
    config = stack_values("dev")
    _zone_candidate(config, 0, active=1)
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    workspace = RecordingWorkspace(values, {"aws": {"fleets": {"aws-train": [world.asg]}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, storage_env(moto.url)),
                         move_back=move_back).once()
    assert (decision.action, decision.at) == ("stay", 1), decision
    assert [(s["index"], s["place"], s["why"]) for s in decision.skipped] == [
        (0, "aws us-east-1a by gpu requirement spot",
         "spot placement score 1 of 10 in us-east-1a for 1 node(s) (GetSpotPlacementScores; under 3)")]
    assert workspace.changes == [] and workspace.ups == []


def _problems(config: dict[str, Any]) -> list[str]:
    try:
        parse_stack(spec_raw(config))
    except SpecError as caught:
        return [str(p) for p in caught.problems]
    return []


@pytest.mark.parametrize(("group", "zone", "second", "place"), [
    (0, "us-east-1a", False, "aws us-east-1a by gpu requirement spot"),  # the network's only zone
    (0, "us-east-1a", True, "aws us-east-1a by gpu requirement spot"),  # one zone (placement group): its first
    (1, "cn-hangzhou-h", False, "alicloud cn-hangzhou-h by gpu requirement spot"),
], ids=["aws-only-zone", "aws-first-zone", "alicloud-only-zone"])
def test_a_zone_candidate_at_the_one_zone_the_group_is_in_is_the_same_place(
        group: int, zone: str, second: bool, place: str) -> None:
    config = stack_values("dev")
    _zone_candidate(config, group, subnet=second)
    config[key("nodeGroups")][group]["capacity"] = [{"zone": zone}]
    assert _problems(config) == [f"nodeGroups[{group}].capacity[0]: is the same place as the group as declared "
                                 f"({place}): change its cloud, region, zone, types or market, or remove it"]


def test_a_zone_candidate_narrowing_a_group_spread_over_two_zones_is_accepted() -> None:
    config = stack_values("dev")
    _zone_candidate(config, 1)  # the Alibaba group (no fabric): every vswitch of its network, h and i
    config[key("nodeGroups")][1]["capacity"] = [{"zone": "cn-hangzhou-h"}]
    assert _problems(config) == []


def test_a_fabric_group_at_a_candidate_in_its_own_zone_keeps_its_hcc_and_placement_group(tmp_path: Path) -> None:
    """Prod's EFA and HCC groups (one zone each, their network's first): a candidate there as declared
    is refused; one there on another market keeps the declared HCC and placement group (no new one
    in the same zone)."""
    def edit(market: dict[str, Any] | None) -> Any:
        def change(values: dict[str, Any]) -> None:
            values.update(fabric_values())
            for group in values[key("nodeGroups")]:
                if group["name"] in ("aws-efa", "tc-hcc"):
                    zone = "us-east-1a" if group["cloud"] == "aws" else "ap-guangzhou-3"
                    cand = {"zone": zone} | ({"market": market} if market else {})
                    group.update(capacity=[cand], activeCandidate=1 if market else 0)
        return change
    with pytest.raises(Exception, match=r"capacity\[0\]: is the same place as the group as declared \(tencentcloud "
                                        r"ap-guangzhou-3 "):
        run_stack("prod", edit(None), tmp_path)
    res = run_stack("prod", edit({"type": "spot"}), tmp_path)
    assert [(r.name, r.inputs["zone"]) for r in res if r.type == "tencentcloud:Cvm/hpcCluster:HpcCluster"] == [
        ("tc-hcc-hcc", "ap-guangzhou-3")]
    assert [r.name for r in res if r.type == "aws:ec2/placementGroup:PlacementGroup" and r.name.startswith(
        "aws-efa-")] == ["aws-efa-pg"]


WINDOW = {"start": "2026-12-20T08:00:00Z", "end": "2026-12-24T08:00:00Z"}


@pytest.mark.parametrize(("group", "market"), [
    (2, {"type": "reserved"}), (0, {"type": "reserved"}), (1, {"type": "elasticity-assurance", **WINDOW}),
    (0, {"type": "capacity-reservation", **WINDOW}), (0, {"type": "capacity-block", **WINDOW})],
    ids=["tencent-reserved", "aws-reserved", "ali-assurance", "aws-odcr", "aws-block"])
def test_a_zone_candidate_on_a_market_bought_for_one_zone_is_refused(group: int, market: dict[str, Any]) -> None:
    zone = SECOND_ZONE[group][1]
    fix = ("bought for one zone: at {zone} it would be bought again while the first is still billed; give the "
           "candidate market: {{type: spot}} or {{type: on-demand}}").format(zone=zone)
    inherited = stack_values("dev")
    _zone_candidate(inherited, group)
    inherited[key("nodeGroups")][group]["market"] = market
    assert f"nodeGroups[{group}].capacity[0].zone: inherits the group's market {market['type']!r}, {fix}" in \
        _problems(inherited)
    own = stack_values("dev")
    _zone_candidate(own, group)
    own[key("nodeGroups")][group]["capacity"][0]["market"] = market
    assert f"nodeGroups[{group}].capacity[0].market: market {market['type']!r} is {fix}" in _problems(own)
    inherited[key("nodeGroups")][group]["capacity"][0]["market"] = {"type": "on-demand"}  # the fix it names
    assert not [p for p in _problems(inherited) if p.startswith(f"nodeGroups[{group}].capacity")]
