"""Reservations as markets (issue 43): capacity-block and capacity-reservation on AWS,
elasticity-assurance on Alibaba, refused on Tencent in one line; the checks of their keys; the
plan prices the reserved hours, used or not; the launch template, the reservation resources and
the trainer contract (RESERVATION_END) the program declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.checks.validation import parse_stack
from infra.clouds.alicloud.fleet import spot_strategy
from infra.clouds.aws.reservation import on_demand_base
from infra.core.errors import SpecError
from infra.resolve.cost import stack_cost
from tests.harness import by_type, key, run_stack, spec_raw, stack_values

BLOCK = {"type": "capacity-block", "start": "2026-12-20T08:00:00Z", "end": "2026-12-24T08:00:00Z",
         "reservationId": "cr-0123456789abcdef0"}
ODCR = {"type": "capacity-reservation", "start": "2026-11-20T08:00:00Z", "end": "2027-01-20T08:00:00Z",
        "reservedNodes": 1, "overflow": "spot"}
ASSURANCE = {"type": "elasticity-assurance", "start": "2026-12-20T00:00:00Z", "end": "2027-03-20T00:00:00Z",
             "reservedNodes": 1, "overflow": "spot"}


def _with(market: dict[str, Any], group: int = 0, itype: str | None = "g4dn.2xlarge") -> Any:
    """The group on `market`; a reservation targeted by id holds one type: the group names it."""
    def edit(config: dict[str, Any]) -> None:
        config[key("nodeGroups")][group]["market"] = dict(market)
        config[key("nodeGroups")][group].pop("schedule", None)
        if market.get("reservationId") and itype and group == 0:  # the AWS group
            config[key("nodeGroups")][group].pop("gpu", None)
            config[key("nodeGroups")][group]["instanceType"] = itype
    return edit


def _problems_of(edit: Any) -> list[str]:
    config = stack_values("dev")
    edit(config)
    with pytest.raises(SpecError) as caught:
        parse_stack(spec_raw(config))
    return [str(p) for p in caught.value.problems]


def _problems(market: dict[str, Any], group: int = 0) -> list[str]:
    config = stack_values("dev")
    _with(market, group)(config)
    with pytest.raises(SpecError) as caught:
        parse_stack(spec_raw(config))
    return [str(p) for p in caught.value.problems]


@pytest.mark.parametrize(("market", "group", "expected"), [
    ({**BLOCK, "reservationId": None}, 0, "nodeGroups[0].market.reservationId: a Capacity Block is bought outside the "
                                          "stack (EC2 PurchaseCapacityBlock): give its id"),
    ({**BLOCK, "end": "2026-12-19T08:00:00Z"}, 0, "nodeGroups[0].market.end: 2026-12-19T08:00:00+00:00 is not after "
                                                  "start 2026-12-20T08:00:00+00:00"),
    ({**BLOCK, "end": "2027-12-19T08:00:00Z"}, 0, "nodeGroups[0].market.end: a capacity-block lasts 1 to 182 days; "
                                                  "this one lasts 364"),
    ({**BLOCK, "end": "2026-12-24T08:00:00"}, 0, "nodeGroups[0].market.end: '2026-12-24T08:00:00'"),
    ({"type": "capacity-block"}, 0, "nodeGroups[0].market: capacity-block needs start and end"),
    ({**ODCR, "start": "2026-12-20T08:00:00Z"}, 0, "nodeGroups[0].market.start: 2026-12-20T08:00:00+00:00 is after "
                                                    "now: EC2 has no start date for an On-Demand Capacity Reservation"),
    ({**ASSURANCE, "end": "2027-03-25T00:00:00Z"}, 1, "nodeGroups[1].market.end: an elasticity assurance is sold for "
                                                      "1 to 9 whole months or 1 to 5 whole years from its start"),
    ({**ASSURANCE, "end": "2028-02-20T00:00:00Z"}, 1, "nodeGroups[1].market.end: an elasticity assurance is sold for "
                                                      "1 to 9 whole months or 1 to 5 whole years"),
    ({**BLOCK, "start": "2026-11-20T08:00:00Z", "end": "2026-11-29T08:00:00+08:00"}, 0,
     "nodeGroups[0].market.end: 2026-11-29T08:00:00+08:00 has passed (now 2026-11-30T00:00:00+00:00): the "
     "reservation is over"),
    ({**BLOCK, "overflow": "spot", "reservedNodes": 1}, 0, "nodeGroups[0].market.overflow: a Capacity Block's launch "
                                                            "template buys only from the block"),
    ({**ODCR, "reservedNodes": 9}, 0, "nodeGroups[0].market.reservedNodes: 9 exceeds scaling.max (2)"),
    ({**ODCR, "reservedNodes": 2}, 0, "nodeGroups[0].market.overflow: nothing overflows"),
    ({"type": "spot", "end": "2026-12-24T08:00:00Z"}, 0, "nodeGroups[0].market.end: applies only to a reservation "
                                                         "market"),
    ({**BLOCK, "reservationId": "cr-1; rm -rf /"}, 0, "nodeGroups[0].market.reservationId: 'cr-1; rm -rf /'"),
    (ASSURANCE, 0, "nodeGroups[0].market.type: 'elasticity-assurance' cannot be bought on an international-site "
                   "AWS account: elasticity assurance is Alibaba Cloud's"),
    (BLOCK, 1, "nodeGroups[1].market.type: 'capacity-block' cannot be bought on a china-site Alibaba Cloud account: "
               "Capacity Blocks are EC2's"),
    (ODCR, 2, "nodeGroups[2].market.type: 'capacity-reservation' cannot be bought on a china-site Tencent Cloud "
              "account: Tencent Cloud CVM offers no capacity reservation for GPU instances"),
])
def test_a_bad_reservation_is_one_line_naming_its_key(market: dict[str, Any], group: int, expected: str) -> None:
    problems = _problems(market, group)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_the_plan_prices_the_reserved_hours_used_or_not() -> None:
    config = stack_values("dev")
    _with(BLOCK)(config)
    stack = parse_stack(spec_raw(config))
    (row,) = [g for g in stack_cost(stack)["node_groups"] if g["name"] == "aws-train"]
    on_demand = stack.group("aws-train").prices.on_demand
    # 2 nodes (scaling.max) x 96 hours, paid whether they run or not; every hour of the month at both nodes
    assert row["reserved_total_usd"] == pytest.approx(2 * 96 * on_demand, abs=0.01)
    assert row["hourly_usd"] == pytest.approx(2 * on_demand + 2 * stack.group("aws-train").prices.disk, abs=1e-3)
    assert stack.group("aws-train").trainer["RESERVATION_END"] == "2026-12-24T08:00:00Z"
    assert stack.group("aws-train").trainer["RESERVATION_NOTICE_S"] == "1800"


def test_a_capacity_block_launch_template_targets_the_block(tmp_path: Path) -> None:
    res = run_stack("dev", _with(BLOCK), tmp_path)
    (lt,) = [t for t in by_type(res, "aws:ec2/launchTemplate:LaunchTemplate") if t.name == "aws-train-lt"]
    assert lt.inputs["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert lt.inputs["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationId": "cr-0123456789abcdef0"}}
    assert not by_type(res, "aws:ec2/capacityReservation:CapacityReservation")  # bought outside the stack
    (asg,) = [g for g in by_type(res, "aws:autoscaling/group:Group") if g.name == "aws-train-asg"]
    dist = asg.inputs["mixedInstancesPolicy"]["instancesDistribution"]
    assert (dist["onDemandBaseCapacity"], dist["onDemandPercentageAboveBaseCapacity"]) == (2, 100)


def test_the_blocks_end_reaches_the_trainer_through_the_nodes_own_env_file(tmp_path: Path) -> None:
    """The seam: the user data the plan gives the block's nodes, laid down as cloud-init writes it,
    holds an env file the contract check passes and the trainer's deadline reads (end - notice)."""
    from datetime import datetime

    from tests.contract_helpers import node_env_of
    from training import contract
    from training.reservation import Deadline

    env = node_env_of(run_stack("dev", _with(BLOCK), tmp_path), "aws", tmp_path)
    assert (env["RESERVATION_END"], env["RESERVATION_NOTICE_S"]) == ("2026-12-24T08:00:00Z", "1800")
    assert not [p for p in contract.problems(env) if "RESERVATION" in p]
    deadline = Deadline.from_env(env, upload_s=90)
    assert deadline.stop_at == datetime.fromisoformat("2026-12-24T08:00:00+00:00").timestamp() - 1800 - 90


def test_a_reserved_baseline_bursts_to_spot_on_aws_and_alibaba(tmp_path: Path) -> None:
    def edit(config: dict[str, Any]) -> None:
        _with(ODCR, 0)(config)
        _with(ASSURANCE, 1)(config)
    res = run_stack("dev", edit, tmp_path)
    (odcr,) = by_type(res, "aws:ec2/capacityReservation:CapacityReservation")
    assert (odcr.inputs["instanceCount"], odcr.inputs["endDate"], odcr.inputs["endDateType"]) == (
        1, "2027-01-20T08:00:00Z", "limited")
    (asg,) = [g for g in by_type(res, "aws:autoscaling/group:Group") if g.name == "aws-train-asg"]
    dist = asg.inputs["mixedInstancesPolicy"]["instancesDistribution"]
    assert (dist["onDemandBaseCapacity"], dist["onDemandPercentageAboveBaseCapacity"]) == (1, 0)
    (ea,) = by_type(res, "alicloud:ecs/elasticityAssurance:ElasticityAssurance")
    assert (ea.inputs["instanceAmount"], ea.inputs["period"], ea.inputs["periodUnit"], ea.inputs["zoneIds"],
            ea.inputs["privatePoolOptionsMatchCriteria"]) == (1, 3, "Month", ["cn-hangzhou-h"], "Open")
    (ess,) = by_type(res, "alicloud:ess/scalingGroup:ScalingGroup")
    assert (ess.inputs["onDemandBaseCapacity"], ess.inputs["onDemandPercentageAboveBaseCapacity"]) == (1, 0)


@pytest.mark.parametrize("overflow", ["spot", None])
def test_both_clouds_burst_to_spot_by_the_markets_one_answer(overflow: str | None) -> None:
    """AWS's ASG split and Alibaba's ESS spot strategy both read Market.bursts_to_spot."""
    config = stack_values("dev")
    drop = {"reservedNodes"} if overflow is None else set()  # without overflow, all of scaling.max
    _with({k: v for k, v in {**ODCR, "overflow": overflow}.items() if k not in drop}, 0)(config)
    _with({k: v for k, v in {**ASSURANCE, "overflow": overflow}.items() if k not in drop}, 1)(config)
    aws, ali = parse_stack(spec_raw(config)).groups[:2]
    assert (aws.cloud, ali.cloud) == ("aws", "alicloud")
    assert aws.market.bursts_to_spot is ali.market.bursts_to_spot is (overflow == "spot")
    assert on_demand_base(aws) == ((1, 0) if overflow else (aws.fleet_max, 100))
    assert spot_strategy(ali) == ("SpotAsPriceGo" if overflow else "NoSpot")


def test_offsets_other_than_utc_reach_the_clouds_as_utc(tmp_path: Path) -> None:
    def edit(config: dict[str, Any]) -> None:
        _with({**ODCR, "end": "2027-01-20T16:00:00+08:00"}, 0)(config)
        _with({**ASSURANCE, "start": "2026-12-20T08:00:00+08:00", "end": "2027-03-20T08:00:00+08:00"}, 1)(config)
    res = run_stack("dev", edit, tmp_path)
    (odcr,) = by_type(res, "aws:ec2/capacityReservation:CapacityReservation")
    assert odcr.inputs["endDate"] == "2027-01-20T08:00:00Z"
    (ea,) = by_type(res, "alicloud:ecs/elasticityAssurance:ElasticityAssurance")
    assert ea.inputs["startTime"] == "2026-12-20T00:00:00Z"


def test_an_elasticity_assurance_buys_exactly_the_calendar_months_priced(tmp_path: Path) -> None:
    # January 1 to February 1 is one month (31 days), not two; a year is sold as a year
    for end, bought in (("2027-02-01T00:00:00+08:00", (1, "Month")), ("2028-01-01T00:00:00+08:00", (1, "Year"))):
        market = {**ASSURANCE, "start": "2027-01-01T00:00:00+08:00", "end": end}
        (tmp_path / end[:4]).mkdir()
        res = run_stack("dev", _with(market, 1), tmp_path / end[:4])
        (ea,) = by_type(res, "alicloud:ecs/elasticityAssurance:ElasticityAssurance")
        assert (ea.inputs["period"], ea.inputs["periodUnit"]) == bought


def test_a_created_odcr_is_used_open_and_a_targeted_one_only_by_a_group_it_can_serve(tmp_path: Path) -> None:
    res = run_stack("dev", _with({**ODCR, "reservedNodes": 1}), tmp_path)
    (lt,) = [t for t in by_type(res, "aws:ec2/launchTemplate:LaunchTemplate") if t.name == "aws-train-lt"]
    assert lt.inputs["capacityReservationSpecification"] == {"capacityReservationPreference": "open"}
    given = {**ODCR, "reservationId": "cr-0123456789abcdef0"}
    assert _problems_of(_with(given, itype=None)) == [
        "nodeGroups[0].market.reservationId: cr-0123456789abcdef0 holds one instance type: give the group "
        "instanceType (the reservation's) and no fallbackTypes"]

    def two_zones(config: dict[str, Any]) -> None:
        _with(given)(config)
        config[key("networks")][0]["subnets"].append({"zone": "us-east-1b", "cidr": "10.10.16.0/20"})
    (line,) = _problems_of(two_zones)
    assert line.startswith("nodeGroups[0].market.reservationId: cr-0123456789abcdef0 is in one zone, but network "
                           "aws-train's subnets span us-east-1a, us-east-1b")
    assert _problems_of(_with({**ODCR, "reservedNodes": 1, "overflow": None})) == [
        "nodeGroups[0].market.reservedNodes: 1 is under scaling.max (2) with no overflow: the nodes above it would "
        "launch outside the reservation at on-demand; raise reservedNodes or set overflow: spot"]
