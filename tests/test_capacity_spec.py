"""nodeGroups[].capacity (issue 43): the candidates are checked like every other key — one line
naming the key and what to add — and the group runs, is planned and priced at its
activeCandidate."""

from __future__ import annotations

from typing import Any

import pytest

from infra.capacity import places
from infra.checks.validation import parse_stack
from infra.core.errors import SpecError
from tests.harness import key, spec_raw, stack_values

TENCENT_T4 = {"cloud": "tencentcloud", "types": ["GN7.2XLARGE32"], "market": {"type": "spot"}}


def _config(*candidates: Any, active: int = 0, group: int = 0) -> dict[str, Any]:
    config = stack_values("dev")
    config[key("nodeGroups")][group]["capacity"] = list(candidates)
    if active:
        config[key("nodeGroups")][group]["activeCandidate"] = active
    return config


def _problems(config: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_stack(spec_raw(config))
    return [str(p) for p in caught.value.problems]


def test_candidates_in_another_region_and_cloud_are_read_in_order() -> None:
    stack = parse_stack(spec_raw(_config({"market": {"type": "on-demand"}}, TENCENT_T4)))
    assert stack.declared is not None
    group = stack.declared.node_groups[0]
    found = places.places(stack.declared, group)
    assert [(p.index, p.cloud, p.region, p.market.type) for p in found] == [
        (0, "aws", "us-east-1", "spot"), (1, "aws", "us-east-1", "on-demand"), (2, "tencentcloud", "ap-guangzhou", "spot")]
    assert found[2].network is not None and found[2].network.name == "tc-train"
    assert stack.group("aws-train").cloud == "aws"  # activeCandidate 0: as declared


def test_the_group_runs_at_its_active_candidate() -> None:
    stack = parse_stack(spec_raw(_config(TENCENT_T4, active=1)))
    moved = stack.group("aws-train")
    assert (moved.cloud, moved.region, moved.network, moved.types) == (
        "tencentcloud", "ap-guangzhou", "tc-train", ("GN7.2XLARGE32",))
    assert moved.bucket.cloud == "tencentcloud" and moved.trainer["CHECKPOINT_URL"].startswith("cosn://")
    assert stack.declared is not None and stack.declared.node_groups[0].cloud == "aws"


@pytest.mark.parametrize(("candidate", "expected"), [
    ({"cloud": "gcp"}, "nodeGroups[0].capacity[0].cloud: 'gcp' is not allowed; use one of aws, alicloud, tencentcloud"),
    ({"region": "us-east-9"}, "nodeGroups[0].capacity[0].region: 'us-east-9' is not a region of AWS known here"),
    ({"zone": "us-east-1z"}, "nodeGroups[0].capacity[0].zone: 'us-east-1z' is not a zone of us-east-1"),
    ({"types": ["g4dn.xlarg"]}, "nodeGroups[0].capacity[0].types[0]: 'g4dn.xlarg' is not a GPU type of AWS in the "
                                "catalog; did you mean 'g4dn.xlarge'?"),
    ({"cloud": "tencentcloud"}, "nodeGroups[0].capacity[0].types: give the tencentcloud instance types"),
    ({"region": "us-west-2", "types": ["g4dn.xlarge"]}, "nodeGroups[0].capacity[0]: the stack has no network on aws "
                                                        "in us-west-2: add networks[] {name: ..., cloud: aws, "
                                                        "region: us-west-2"),
    ({"zone": "us-east-1c", "types": ["g4dn.xlarge"]}, "nodeGroups[0].capacity[0].zone: 'us-east-1c': the group's "
                                                       "network 'aws-train' has no subnet in us-east-1c: add {zone: "
                                                       "us-east-1c, cidr: ...} to networks[0].subnets"),
    ({"region": "us-west-2", "zone": "us-west-2a", "types": ["g4dn.xlarge"]},
     "nodeGroups[0].capacity[0].zone: 'us-west-2a': the stack has no network on aws in us-west-2 with a subnet in "
     "us-west-2a: add networks[] {name: ..., cloud: aws, region: us-west-2"),
    ({"types": ["g4dn.xlarge; rm -rf /"]}, "nodeGroups[0].capacity[0].types[0]: 'g4dn.xlarge; rm -rf /': is not a valid value"),
    ({"region": "\x00"}, "nodeGroups[0].capacity[0].region: '\\x00': is not a valid value"),
    ({"market": {"type": "bid"}}, "nodeGroups[0].capacity[0].market.type: 'bid' is not allowed"),
    ({"colud": "aws"}, "nodeGroups[0].capacity[0].colud"),
])
def test_a_bad_candidate_is_one_line_naming_its_key(candidate: dict[str, Any], expected: str) -> None:
    problems = _problems(_config(candidate))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_a_candidate_the_same_as_the_group_or_another_is_refused() -> None:
    problems = _problems(_config({"market": {"type": "spot"}}))
    assert problems == ["nodeGroups[0].capacity[0]: is the same place as the group as declared (aws us-east-1 by gpu "
                        "requirement spot): change its cloud, region, zone, types or market, or remove it"]
    assert _problems(_config(TENCENT_T4, TENCENT_T4))[0].startswith("nodeGroups[0].capacity[1]: is the same place as "
                                                                    "capacity[0]")


def test_a_cloud_without_account_or_registry_says_what_to_add() -> None:
    config = _config(TENCENT_T4)
    del config[key("clouds")]["tencentcloud"]
    config[key("networks")] = [n for n in config[key("networks")] if n["cloud"] != "tencentcloud"]
    config[key("nodeGroups")] = [g for g in config[key("nodeGroups")] if g["cloud"] != "tencentcloud"]
    assert _problems(config) == ["nodeGroups[0].capacity[0].cloud: 'tencentcloud' has no account in this stack: add "
                                 "clouds.tencentcloud (its region; the stack's bucket there comes with it) or remove "
                                 "the candidate"]
    config = _config(TENCENT_T4)  # an account and a network, but no group there: no registry
    config[key("nodeGroups")] = [g for g in config[key("nodeGroups")] if g["cloud"] != "tencentcloud"]
    assert _problems(config) == ["nodeGroups[0].capacity[0]: no image registry on tencentcloud: the stack builds one "
                                 "only on a cloud with a node group; add training.prebuiltImages.tencentcloud (a "
                                 "trainer image pinned by digest) or a node group on tencentcloud"]


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda g: g.__setitem__("activeCandidate", 3), "nodeGroups[0].activeCandidate: 3 names no place"),
    (lambda g: g.__setitem__("activeCandidate", -1), "nodeGroups[0].activeCandidate: -1: Input should be greater than"),
    (lambda g: g.__setitem__("activeCandidate", True), "nodeGroups[0].activeCandidate: true is a YAML boolean, not a number"),
    (lambda g: g.__setitem__("capacity", [TENCENT_T4] * 17), "nodeGroups[0].capacity: List should have at most 16"),
    (lambda g: g.__setitem__("capacity", "tencentcloud"), "nodeGroups[0].capacity: 'tencentcloud': Input should be a valid list"),
])
def test_hostile_capacity_values_are_refused(edit: Any, expected: str) -> None:
    config = _config(TENCENT_T4)
    edit(config[key("nodeGroups")][0])
    problems = _problems(config)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# -- pricing and the pack's cap ---------------------------------------------------------------------

def _pack_verdicts(config: dict[str, Any], **settings: Any) -> list[str]:
    from infra.stack.policy_config import for_stack
    from policies.gts_policy.rules import evaluate

    cfg = for_stack("dev", parse_stack(spec_raw(config)))
    cfg["capacity-candidates-capped"] = {**cfg["capacity-candidates-capped"], **settings}
    return [f"{v['resource']}: {v['message']}" for v in evaluate([], cfg) if v["policy"] == "capacity-candidates-capped"]


def test_the_plan_prices_every_place_and_what_a_move_copies() -> None:
    from infra.resolve.cost import stack_cost

    rows = stack_cost(parse_stack(spec_raw(_config(TENCENT_T4, {"market": {"type": "on-demand"}}))))["capacity_places"]
    assert [(r["index"], r["place"], r["market"]) for r in rows] == [
        (0, "aws us-east-1a g4dn.2xlarge spot", "spot"), (1, "tencentcloud ap-guangzhou GN7.2XLARGE32 spot", "spot"),
        (2, "aws us-east-1 g4dn.2xlarge on-demand", "on-demand")]
    # max 2 nodes (infra/data/prices.csv, 0.70 typical spot discount): 2 x 0.752 x 0.3, 2 x 8.68 CNY / 7.2 x 0.3, 2 x 0.752
    assert [r["hourly_usd"] for r in rows] == [pytest.approx(2 * 0.752 * 0.3, abs=1e-4),
                                               pytest.approx(2 * 8.68 / 7.2 * 0.3, abs=1e-4), 1.504]
    # moving to Tencent copies at most storage.expectedGb (200) out of the AWS bucket at $0.09/GB; within AWS nothing
    assert [(r["move_gb"], r["move_usd"]) for r in rows] == [(0.0, 0.0), (200.0, 18.0), (0.0, 0.0)]


def test_the_pack_refuses_a_candidate_over_the_cap_or_on_demand_unless_allowed() -> None:
    config = _config(TENCENT_T4, {"market": {"type": "on-demand"}})
    verdicts = _pack_verdicts(config)
    # Tencent spot without a cap: at on-demand, $2.41/h > 1.5 x $0.45/h; AWS on-demand: $1.50/h, over the cap and
    # on-demand
    assert [v.split(":")[0] for v in verdicts] == ["aws-train capacity[0]", "aws-train capacity[1]",
                                                   "aws-train capacity[1]"]
    assert ("$2.41/h at the group's maximum size (spot at its cap, or at on-demand without one), over 1.5 x the "
            "declared place's $0.45/h ($0.68/h)") in verdicts[0]
    assert verdicts[2].endswith("buys 2 node(s) on-demand: use a spot market there, or set capacity-candidates-capped "
                                "allowOnDemand: true")
    assert _pack_verdicts(config, maxRatio=6, allowOnDemand=True) == []
    # a spot cap is the worst case: Tencent capped at $0.30 per node-hour is 2 x $0.30 = $0.60/h, under $0.68/h
    capped = _config({**TENCENT_T4, "market": {"type": "spot", "spotMaxPriceUsd": 0.3}})
    assert _pack_verdicts(capped) == []
    assert _pack_verdicts(_config()) == []  # no candidates: nothing to judge
