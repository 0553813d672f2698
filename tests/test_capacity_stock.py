"""Stock and launch failures asked of each cloud's own API (infra/clouds/<cloud>/stock.py): AWS
through boto3 against moto (with recorded answers for what moto lacks), Alibaba and Tencent
through the project's own signers against recorded responses. A candidate without stock is
refused in a few calls; capacity failures are read from the scaling service's activities."""

from __future__ import annotations

import email.message
import urllib.error
import urllib.request
from typing import Any

import pytest

from infra.capacity.stock import Ask, stock_api
from infra.model.spec_capacity import Market
from tests.capacity_helpers import AwsCalls, Replay, moto_aws, recorded
from training import cloudmeta

CREDS = cloudmeta.Credentials("AKIDEXAMPLE", "secret-example", "token-example", 0.0)

SPOT, ON_DEMAND = Market(type="spot"), Market(type="on-demand")


def _denying(replay: Replay, action: str) -> Any:
    """The replay, but `action` answered 403 (the operator's keys lack its permission)."""
    def send(request: urllib.request.Request, timeout: float) -> dict[str, Any]:
        if action in request.full_url or dict(request.header_items()).get("X-tc-action") == action:
            raise urllib.error.HTTPError(request.full_url, 403, "Forbidden", email.message.Message(), None)
        return replay(request, timeout)
    return send


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def _aws(region: str) -> tuple[AwsCalls, Any]:
    calls = AwsCalls(region)
    return calls, stock_api("aws", region, ec2=calls.ec2, autoscaling=calls.autoscaling, quotas=calls.quotas)


def test_aws_a_low_spot_score_is_no_stock_in_three_calls() -> None:
    with moto_aws():
        calls, api = _aws("us-east-1")
        calls.answer(calls.quotas, "GetServiceQuota", recorded("aws", "service_quota_g_spot"))
        calls.answer(calls.ec2, "GetSpotPlacementScores", recorded("aws", "spot_placement_scores_low"))
        verdict = api.ask(Ask("us-east-1", None, ("g4dn.xlarge",), SPOT, 2, 4))
    assert not verdict.ok and verdict.why.startswith("spot placement score 2 of 10 in us-east-1")
    assert calls.calls == ["DescribeInstanceTypeOfferings", "GetServiceQuota", "GetSpotPlacementScores"]
    assert verdict.calls == 3


def test_aws_a_type_not_sold_or_over_quota_stops_before_the_score() -> None:
    with moto_aws():
        calls, api = _aws("us-east-1")
        verdict = api.ask(Ask("us-east-1", None, ("p9.nonexistent",), SPOT, 1, 8))
        assert (verdict.ok, verdict.calls) == (False, 1) and "not offered in us-east-1" in verdict.why
        calls.answer(calls.quotas, "GetServiceQuota", recorded("aws", "service_quota_g_spot"))  # 64 vCPUs
        verdict = api.ask(Ask("us-east-1", None, ("g4dn.12xlarge",), SPOT, 2, 48))
    assert (verdict.ok, verdict.calls) == (False, 2)
    assert verdict.why == "vCPU quota 64 for g4dn.12xlarge (spot) is under the 96 the nodes need (GetServiceQuota)"


def test_aws_a_good_score_in_the_zone_is_stock() -> None:
    with moto_aws():
        calls, api = _aws("us-west-2")
        zone_id = calls.ec2.describe_availability_zones(ZoneNames=["us-west-2a"])["AvailabilityZones"][0]["ZoneId"]
        calls.calls.clear()
        calls.answer(calls.quotas, "GetServiceQuota", recorded("aws", "service_quota_g_spot"))
        calls.answer(calls.ec2, "GetSpotPlacementScores",
                     recorded("aws", "spot_placement_scores_high", **{"usw2-az1": zone_id}))
        verdict = api.ask(Ask("us-west-2", "us-west-2a", ("g4dn.xlarge",), SPOT, 2, 4))
    assert verdict.ok and verdict.why == "spot placement score 9 of 10 in us-west-2a"
    assert verdict.calls == 4 == len(calls.calls)


def test_aws_launch_failures_are_the_groups_capacity_activities() -> None:
    with moto_aws():
        calls, api = _aws("us-east-1")
        calls.answer(calls.autoscaling, "DescribeScalingActivities",
                     recorded("aws", "scaling_activities_insufficient", GROUP="gts-dev-aws-train"))
        found = api.failures("gts-dev-aws-train")
        assert api.failures("gts-dev-aws-train", since="2026-12-02T00:00:01") == []
        calls, api = _aws("us-east-1")
        calls.answer(calls.autoscaling, "DescribeScalingActivities",
                     recorded("aws", "scaling_activities_recovered", GROUP="gts-dev-aws-train"))
        assert api.failures("gts-dev-aws-train") == []  # a launch succeeded after it
    assert [f.message.split(" - ")[0] for f in found] == ["Could not launch Spot Instances. InsufficientInstanceCapacity"]


def test_alicloud_asks_all_the_types_in_one_signed_call_and_takes_the_first_in_stock_in_the_groups_order() -> None:
    replay = Replay({"DescribeAvailableResource": [recorded("alicloud", "available_resource_two_types")],
                     "DescribeAccountAttributes": [recorded("alicloud", "account_attributes_spot")]})
    api = stock_api("alicloud", "cn-hangzhou", creds=CREDS, send=replay)
    # 2 nodes of the type in stock (4 vCPUs each) need 8 of the 8 left; the first type's 8 each would not fit
    verdict = api.ask(Ask("cn-hangzhou", "cn-hangzhou-h", ("ecs.gn7i-c8g1.2xlarge", "ecs.gn6i-c4g1.xlarge"), SPOT,
                          2, 8, (8, 4)))
    assert verdict.ok and verdict.calls == 2
    assert verdict.why == ("ecs.gn6i-c4g1.xlarge WithStock in cn-hangzhou-h (DescribeAvailableResource), "
                           "vCPU quota left 8 (DescribeAccountAttributes)")
    action, params, _ = replay.asked[0]
    assert action == "DescribeAvailableResource" and params["DestinationResource"] == "InstanceType"
    assert "InstanceType" not in params  # one answer for every type
    assert (params["ZoneId"], params["InstanceChargeType"], params["SpotStrategy"]) == (
        "cn-hangzhou-h", "PostPaid", "SpotAsPriceGo")
    assert params["AccessKeyId"] == "AKIDEXAMPLE" and params["Signature"] and params["SignatureMethod"] == "HMAC-SHA1"
    assert replay.timeouts == [4.0, 4.0]  # no budget given: each call its full timeout


def test_alicloud_stock_without_the_vcpu_quota_for_the_nodes_is_refused_and_each_market_asks_its_own() -> None:
    quota = recorded("alicloud", "account_attributes_spot")  # 40 spot vCPUs, 32 used: 8 left
    replay = Replay({"DescribeAvailableResource": [recorded("alicloud", "available_resource_with_stock")] * 4,
                     "DescribeAccountAttributes": [quota, {"AccountAttributeItems": {"AccountAttributeItem": []}},
                                                   {"AccountAttributeItems": {"AccountAttributeItem": []}}]})
    api = stock_api("alicloud", "cn-hangzhou", creds=CREDS, send=replay)
    short = api.ask(Ask("cn-hangzhou", "cn-hangzhou-h", ("ecs.gn6i-c4g1.xlarge",), SPOT, 2, 8))
    assert (short.ok, short.calls) == (False, 2)
    assert short.why == ("vCPU quota left 8 (max-spot-instance-vcpu-count 40, used 32) is under the 16 the nodes "
                         "need (DescribeAccountAttributes)")
    _, params, _ = replay.asked[1]
    assert (params["AttributeName.1"], params["AttributeName.2"], params["ZoneId"]) == (
        "max-spot-instance-vcpu-count", "used-spot-instance-vcpu-count", "cn-hangzhou-h")
    unknown = api.ask(Ask("cn-hangzhou", None, ("ecs.gn6i-c4g1.xlarge",), ON_DEMAND, 2, 8))
    assert unknown.ok and unknown.why.endswith("vCPU quota left unknown (DescribeAccountAttributes)")
    assert replay.asked[3][1]["AttributeName.1"] == "max-postpaid-instance-vcpu-count" and "ZoneId" not in replay.asked[3][1]
    assurance = Market(type="elasticity-assurance", start="2026-12-20T00:00:00Z", end="2027-03-20T00:00:00Z")
    assert api.ask(Ask("cn-hangzhou", None, ("ecs.gn6i-c4g1.xlarge",), assurance, 2, 8)).ok
    assert replay.asked[5][1]["AttributeName.1"] == "max-postpaid-instance-vcpu-count"  # an assurance's are pay-as-you-go
    prepaid = api.ask(Ask("cn-hangzhou", None, ("ecs.gn6i-c4g1.xlarge",), Market(type="reserved"), 2, 8))
    assert (prepaid.ok, prepaid.calls) == (True, 1) and prepaid.why.endswith("quota not asked (prepaid)")


def test_alicloud_a_quota_of_another_zone_or_of_several_is_unknown_and_a_failed_quota_call_keeps_the_stock() -> None:
    def attributes(*items: tuple[str, list[dict[str, str]]]) -> dict[str, Any]:
        return {"AccountAttributeItems": {"AccountAttributeItem": [
            {"AttributeName": name, "AttributeValues": {"ValueItem": values}} for name, values in items]}}

    other_zone = attributes(("max-spot-instance-vcpu-count", [{"Value": "4", "ZoneId": "cn-hangzhou-i"}]))
    split = attributes(("max-spot-instance-vcpu-count", [{"Value": "100"}]),
                       ("used-spot-instance-vcpu-count", [{"Value": "8", "ZoneId": "cn-hangzhou-h"}, {"Value": "90"}]))
    stock = recorded("alicloud", "available_resource_with_stock")
    replay = Replay({"DescribeAvailableResource": [stock, stock, stock], "DescribeAccountAttributes": [other_zone, split]})
    api = stock_api("alicloud", "cn-hangzhou", creds=CREDS, send=replay)
    ask = Ask("cn-hangzhou", "cn-hangzhou-h", ("ecs.gn6i-c4g1.xlarge",), SPOT, 2, 8)
    assert api.ask(ask).why.endswith("vCPU quota left unknown (DescribeAccountAttributes)")  # cn-hangzhou-i's is not ours
    # 100 - 8 would pass; the used count has two values that could apply: unknown, never the smaller one
    assert api.ask(ask).why.endswith("vCPU quota left 100 (DescribeAccountAttributes)")
    api = stock_api("alicloud", "cn-hangzhou", creds=CREDS, send=_denying(replay, "DescribeAccountAttributes"))
    denied = api.ask(ask)  # a RAM policy without ecs:DescribeAccountAttributes
    assert denied.ok and "vCPU quota unknown (HTTPError: HTTP Error 403: Forbidden)" in denied.why


def test_alicloud_sold_out_is_no_stock_and_no_stock_activities_are_failures() -> None:
    replay = Replay({"DescribeAvailableResource": [recorded("alicloud", "available_resource_sold_out")],
                     "DescribeScalingActivities": [recorded("alicloud", "scaling_activities_no_stock")]})
    api = stock_api("alicloud", "cn-hangzhou", creds=CREDS, send=replay)
    verdict = api.ask(Ask("cn-hangzhou", None, ("ecs.gn7i-c8g1.2xlarge",), ON_DEMAND, 1, 8))
    assert (verdict.ok, verdict.calls) == (False, 1)
    assert verdict.why == "ecs.gn7i-c8g1.2xlarge WithoutStock in cn-hangzhou (DescribeAvailableResource)"
    assert replay.asked[0][1]["SpotStrategy"] == "NoSpot"
    found = api.failures("asg-bp18p2yfxow2dloqabcd")
    assert len(found) == 1 and "OperationDenied.NoStock" in found[0].message
    assert replay.asked[1][1]["ScalingGroupId"] == "asg-bp18p2yfxow2dloqabcd"


def test_alicloud_a_later_successful_activity_clears_a_failure_and_the_group_is_short() -> None:
    failed = recorded("alicloud", "scaling_activities_no_stock")
    later = {"ScalingActivityId": "asa-later", "StartTime": "2026-12-02T00:05Z", "StatusCode": "Successful",
             "StatusMessage": "", "Description": "Add \"1\" ECS instances"}
    recovered = {**failed, "ScalingActivities": {"ScalingActivity": [later, *failed["ScalingActivities"]["ScalingActivity"]]}}
    replay = Replay({"DescribeScalingActivities": [recovered, failed], "DescribeScalingGroups":
                     [recorded("alicloud", "scaling_groups_short")]})
    api = stock_api("alicloud", "cn-hangzhou", creds=CREDS, send=replay)
    assert api.failures("asg-bp18p2yfxow2dloqabcd") == []
    assert api.failures("asg-bp18p2yfxow2dloqabcd", since="2026-12-02T00:00:30Z") == []
    assert api.nodes("asg-bp18p2yfxow2dloqabcd") == (1, 2)
    assert replay.asked[2][1]["ScalingGroupIds.1"] == "asg-bp18p2yfxow2dloqabcd"


def test_tencentcloud_asks_the_zone_configuration_signed_tc3() -> None:
    replay = Replay({"DescribeZoneInstanceConfigInfos": [recorded("tencentcloud", "zone_config_sold_out"),
                                                         recorded("tencentcloud", "zone_config_in_stock")],
                     "DescribeAccountQuota": [recorded("tencentcloud", "account_quota_spot")],
                     "DescribeAutoScalingActivities": [recorded("tencentcloud", "activities_sold_out")]})
    api = stock_api("tencentcloud", "ap-guangzhou", creds=CREDS, send=replay)
    ask = Ask("ap-guangzhou", "ap-guangzhou-3", ("GN7.2XLARGE32",), SPOT, 2, 8)
    sold = api.ask(ask)
    assert (sold.ok, sold.calls) == (False, 1)
    assert sold.why == "GN7.2XLARGE32 SOLD_OUT/WithoutStock in ap-guangzhou-3 (DescribeZoneInstanceConfigInfos)"
    found = api.ask(ask)
    assert (found.ok, found.calls) == (True, 2)
    assert found.why.endswith("in ap-guangzhou-3 (DescribeZoneInstanceConfigInfos), quota left 6 (DescribeAccountQuota)")
    assert {f["Name"]: f["Values"] for f in replay.asked[2][1]["Filters"]} == {
        "zone": ["ap-guangzhou-3"], "quota-type": ["SpotPaidQuotaSet"]}
    action, params, headers = replay.asked[0]
    assert action == "DescribeZoneInstanceConfigInfos" and headers["X-tc-version"] == "2017-03-12"
    assert {f["Name"]: f["Values"] for f in params["Filters"]} == {
        "instance-type": ["GN7.2XLARGE32"], "instance-charge-type": ["SPOTPAID"], "zone": ["ap-guangzhou-3"]}
    assert headers["Authorization"].startswith("TC3-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    failed = api.failures("asg-kiju7yt5")
    assert len(failed) == 1 and failed[0].message.startswith("ResourceInsufficient.SpecifiedInstanceType")


def test_tencentcloud_stock_with_fewer_instances_of_quota_left_than_nodes_is_refused() -> None:
    stock = recorded("tencentcloud", "zone_config_in_stock")
    replay = Replay({"DescribeZoneInstanceConfigInfos": [stock, stock],
                     "DescribeAccountQuota": [recorded("tencentcloud", "account_quota_spot"), {"Response": {}}]})
    api = stock_api("tencentcloud", "ap-guangzhou", creds=CREDS, send=replay)
    short = api.ask(Ask("ap-guangzhou", None, ("GN7.2XLARGE32",), SPOT, 7, 8))  # 6 left in ap-guangzhou-3
    assert (short.ok, short.calls) == (False, 2)
    assert short.why == "SpotPaidQuotaSet RemainingQuota 6 in ap-guangzhou-3 is under the 7 nodes (DescribeAccountQuota)"
    assert {f["Name"]: f["Values"] for f in replay.asked[1][1]["Filters"]}["zone"] == ["ap-guangzhou-3"]
    unknown = api.ask(Ask("ap-guangzhou", None, ("GN7.2XLARGE32",), SPOT, 7, 8))
    assert unknown.ok and unknown.why.endswith("quota unknown (DescribeAccountQuota)")


def test_tencentcloud_prepaid_is_held_to_what_one_purchase_may_buy_and_a_failed_quota_call_keeps_the_stock() -> None:
    stock = recorded("tencentcloud", "zone_config_in_stock")
    once = {"Response": {"AccountQuotaOverview": {"AccountQuota": {"PrePaidQuotaSet": [
        {"Zone": "ap-guangzhou-3", "UsedQuota": 0, "RemainingQuota": 50, "TotalQuota": 50, "OnceQuota": 3}]}}}}
    replay = Replay({"DescribeZoneInstanceConfigInfos": [stock, stock], "DescribeAccountQuota": [once]})
    api = stock_api("tencentcloud", "ap-guangzhou", creds=CREDS, send=replay)
    prepaid = api.ask(Ask("ap-guangzhou", None, ("GN7.2XLARGE32",), Market(type="reserved"), 4, 8))
    assert (prepaid.ok, prepaid.why) == (False, "PrePaidQuotaSet OnceQuota 3 in ap-guangzhou-3 is under the 4 nodes "
                                                "(DescribeAccountQuota)")
    api = stock_api("tencentcloud", "ap-guangzhou", creds=CREDS, send=_denying(replay, "DescribeAccountQuota"))
    denied = api.ask(Ask("ap-guangzhou", None, ("GN7.2XLARGE32",), SPOT, 2, 8))  # a CAM policy without the action
    assert denied.ok and "quota unknown (HTTPError: HTTP Error 403: Forbidden)" in denied.why


def test_tencentcloud_failures_since_go_as_start_time_and_a_full_group_is_not_short() -> None:
    replay = Replay({"DescribeAutoScalingActivities": [recorded("tencentcloud", "activities_sold_out")],
                     "DescribeAutoScalingGroups": [recorded("tencentcloud", "groups_full")]})
    api = stock_api("tencentcloud", "ap-guangzhou", creds=CREDS, send=replay)
    assert api.failures("asg-kiju7yt5", since="2026-12-02T08:00:00+08:00") == []  # 00:00Z: not after it
    assert replay.asked[0][1]["StartTime"] == "2026-12-02T00:00:00Z"
    assert api.nodes("asg-kiju7yt5") == (2, 2)
    assert replay.asked[1][1]["Filters"] == [{"Name": "auto-scaling-group-id", "Values": ["asg-kiju7yt5"]}]


def test_ask_within_answers_raises_the_calls_error_or_gives_up_at_the_budget() -> None:
    import threading

    from infra.capacity.stock import NoAnswer, Verdict, ask_within

    ask = Ask("r", None, ("t",), SPOT, 1, 8)

    class Api:
        def __init__(self, answer: Any) -> None:
            self.answer, self.release = answer, threading.Event()

        def ask(self, _: Ask) -> Verdict:
            if self.answer == "hang":
                self.release.wait(60)
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer  # type: ignore[no-any-return]

    assert ask_within(lambda: Api(Verdict(True, "ok", 1)), ask) == Verdict(True, "ok", 1)  # type: ignore[arg-type,return-value]
    with pytest.raises(PermissionError, match="denied"):
        ask_within(lambda: Api(PermissionError("denied")), ask)  # type: ignore[arg-type,return-value]
    hung = Api("hang")
    try:
        with pytest.raises(NoAnswer, match="no answer within 0.05 s"):
            ask_within(lambda: hung, ask, budget_s=0.05)  # type: ignore[arg-type,return-value]
    finally:
        hung.release.set()
    opening = threading.Event()  # opening the client counts in the budget
    with pytest.raises(NoAnswer):
        ask_within(lambda: opening.wait(60) and hung, ask, budget_s=0.05)  # type: ignore[arg-type,return-value]
    opening.set()


def test_an_abandoned_question_makes_no_call_after_its_budget_and_each_call_gets_what_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake clock (no thread, no real wait): the first call gets what is left of the budget, it
    answers after the deadline, and the quota call that would follow is never made."""
    import time

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # the module reads time.monotonic at each call
    replay = Replay({"DescribeZoneInstanceConfigInfos": [recorded("tencentcloud", "zone_config_in_stock")],
                     "DescribeAccountQuota": [recorded("tencentcloud", "account_quota_spot")]})

    def slow(request: urllib.request.Request, timeout: float) -> dict[str, Any]:
        answer = replay(request, timeout)
        clock[0] += 5.0  # the answer comes after the deadline
        return answer

    api = stock_api("tencentcloud", "ap-guangzhou", creds=CREDS, send=slow)
    late = api.ask(Ask("ap-guangzhou", None, ("GN7.2XLARGE32",), SPOT, 2, 8, deadline=100.25))
    # the stock call answered in stock, but the quota call was never made: the budget was spent
    assert [a[0] for a in replay.asked] == ["DescribeZoneInstanceConfigInfos"]
    assert replay.timeouts == [pytest.approx(0.25)]  # the first call's timeout was what was left of it
    assert late.ok and "quota unknown (NoAnswer: the budget was spent before this call)" in late.why


@pytest.mark.parametrize("cloud", ["alicloud", "tencentcloud"])
def test_each_clouds_own_transport_hands_the_calls_timeout_to_urlopen(cloud: str, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    import importlib

    module = importlib.import_module(f"infra.clouds.{cloud}.stock")
    given: list[float] = []

    def urlopen(request: urllib.request.Request, timeout: float) -> Any:
        given.append(timeout)
        raise urllib.error.URLError("no network in this test")

    monkeypatch.setattr(module.urllib.request, "urlopen", urlopen)
    with pytest.raises(urllib.error.URLError):
        module._send(urllib.request.Request("https://example.invalid/"), 1.25)
    assert given == [1.25]
