"""Warm spares in the plan (nodeGroups[].scaling.spares, infra/resolve/spares.py): each cloud's scaling
group holds the run's nodes plus the spares while the run's world (NNODES) stays scaling.max;
the key is refused where spares cannot work; the plan prices them on a line of their own; the
policy pack caps their share and weighs their cost against the run's expected losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.checks.validation import parse_stack
from infra.core import catalog as cat
from infra.core.errors import SpecError
from infra.resolve.cost import group_cost
from infra.resolve.groups import resolve
from infra.stack.policy_config import for_stack
from infra.stack.stackfile import teams_reader
from tests.contract_helpers import container_env, job_containers
from tests.harness import ROOT, by_type, key, parse_spec, policy_hits, run_stack, spec_raw, stack_values
from training import contract as c

VM_TRAINING = ("aws-train", "ali-train", "tc-train")


def _with_spares(config: dict[str, Any], spares: int = 1, names: tuple[str, ...] = VM_TRAINING) -> None:
    for group in config[key("nodeGroups")]:
        if group["name"] in names:
            group["scaling"] = {"min": 2, "max": 4, "desired": 4, "spares": spares}
            group.pop("schedule", None)


def _edited(spares: int = 1, names: tuple[str, ...] = VM_TRAINING) -> dict[str, Any]:
    config = stack_values("prod")
    _with_spares(config, spares, names)
    return config


def test_each_clouds_scaling_group_holds_the_world_plus_the_spares_and_the_world_stays(tmp_path: Path) -> None:
    """min = max = desired = the world plus the spares: every group ignores later changes of its
    desired capacity (the cloud's own scaling moves it), so spares added to a running stack come
    only from the raised minimum, which the cloud's group then fills by itself."""
    res = run_stack("prod", lambda cfg: _with_spares(cfg), tmp_path)
    [asg] = [r for r in by_type(res, "aws:autoscaling/group:Group") if r.name == "aws-train-asg"]
    assert (asg.inputs["minSize"], asg.inputs["maxSize"], asg.inputs["desiredCapacity"]) == (5, 5, 5)
    [ess] = [r for r in by_type(res, "alicloud:ess/scalingGroup:ScalingGroup") if r.name == "ali-train-ess"]
    assert (ess.inputs["minSize"], ess.inputs["maxSize"], ess.inputs["desiredCapacity"]) == (5, 5, 5)
    # Tencent: the spot group's on-demand base (1) is a fixed instance; the AS group has the rest.
    [tas] = [r for r in by_type(res, "tencentcloud:As/scalingGroup:ScalingGroup") if r.name == "tc-train-asg"]
    assert (tas.inputs["minSize"], tas.inputs["maxSize"], tas.inputs["desiredCapacity"]) == (4, 4, 4)
    for group in (asg, ess, tas):  # why the minimum must carry the spares
        assert "desiredCapacity" in group.options["ignoreChanges"], group.options
    stack = parse_stack(spec_raw(_edited()), teams=teams_reader(ROOT))
    for name in VM_TRAINING:
        env = stack.group(name).trainer
        assert (env[c.NNODES.name], env[c.MIN_NNODES.name]) == ("4", "2"), name


def test_without_spares_the_groups_are_as_before(tmp_path: Path) -> None:
    res = run_stack("prod", lambda cfg: _with_spares(cfg, 0), tmp_path)
    [asg] = [r for r in by_type(res, "aws:autoscaling/group:Group") if r.name == "aws-train-asg"]
    assert (asg.inputs["minSize"], asg.inputs["maxSize"], asg.inputs["desiredCapacity"]) == (2, 4, 4)


def _refused(edit: Any) -> list[str]:
    config = stack_values("prod")
    edit(config)
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_raw(config))
    return [str(p) for p in caught.value.problems]


def _group(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in config[key("nodeGroups")] if g["name"] == name)


@pytest.mark.parametrize("name,scaling,why", [
    ("aws-eks-train", {"min": 0, "max": 4, "desired": 4, "spares": 1},
     "the pool holds at most 4 nodes (scaling.max) and the Job asks for 4 + 1 pods, one node each; raise scaling.max to 5"),
    ("aws-eks-infer", {"min": 1, "max": 6, "desired": 1, "spares": 1}, "only a multi-node training run"),
    ("aws-train", {"min": 1, "max": 8, "desired": 2, "spares": 1}, "the run's world is not full (desired 2 < max 8)"),
    ("aws-train", {"min": 1, "max": 1, "spares": 1}, "only a multi-node training run"),
])
def test_spares_where_they_cannot_work_are_refused_by_key(name: str, scaling: dict[str, int], why: str) -> None:
    def edit(config: dict[str, Any]) -> None:
        group = _group(config, name)
        group["scaling"] = scaling
        if name == "aws-train" and scaling["max"] == 1:
            group.pop("schedule", None)
            group["market"] = {"type": "spot"}
        elif name != "aws-train":
            group.pop("schedule", None)

    problems = _refused(edit)
    index = [g["name"] for g in stack_values("prod")[key("nodeGroups")]].index(name)
    assert any(p.startswith(f"nodeGroups[{index}].scaling.spares: 1: ") and why in p and p.endswith("or set 0")
               for p in problems), problems


def test_spares_with_a_schedule_and_on_fixed_instances_are_refused() -> None:
    def scheduled(config: dict[str, Any]) -> None:
        _group(config, "aws-train")["scaling"] = {"min": 1, "max": 2, "desired": 2, "spares": 1}

    assert any("scaling.spares: 1: a schedule changes the group's size" in p for p in _refused(scheduled))

    def reserved(config: dict[str, Any]) -> None:
        _with_spares(config, 1, ("ali-train",))
        _group(config, "ali-train")["market"] = {"type": "reserved"}

    assert any("scaling.spares: 1: the group's nodes are fixed instances" in p for p in _refused(reserved))


def test_more_spares_than_the_runs_nodes_are_refused_by_key() -> None:
    problems = _refused(lambda cfg: _with_spares(cfg, 5, ("aws-train",)))
    index = [g["name"] for g in stack_values("prod")[key("nodeGroups")]].index("aws-train")
    assert (f"nodeGroups[{index}].scaling.spares: 5: more warm spares than the run has nodes (scaling.max 4); "
            "set at most 4") in problems, problems


def test_a_negative_count_is_refused_by_the_schema() -> None:
    problems = _refused(lambda cfg: _group(cfg, "aws-train").__setitem__("scaling", {"min": 1, "max": 2, "spares": -1}))
    assert any("spares" in p and "greater than or equal to 0" in p for p in problems), problems


def test_the_plan_prices_the_spares_on_their_own_line_and_counts_them_in_the_group() -> None:
    with_spares = resolve(parse_spec(spec_raw(_edited(2, ("aws-train",)))))
    without = resolve(parse_spec(spec_raw(_edited(0, ("aws-train",)))))
    rg = with_spares.group("aws-train")
    cost, base = group_cost(rg), group_cost(without.group("aws-train"))
    spot_node = rg.prices.spot + rg.prices.disk  # the spares are above the on-demand base: spot
    assert cost.spares == 2
    assert cost.spares_monthly_usd == pytest.approx(2 * spot_node * cat.HOURS_PER_MONTH, abs=0.01)
    assert cost.monthly_usd - base.monthly_usd == pytest.approx(cost.spares_monthly_usd, abs=0.05)
    assert cost.peak_nodes == 6 and base.spares == 0 and base.spares_monthly_usd == 0
    assert cost.losses_per_month > 0  # four spot nodes of a 10-15 % band type lose members every month


def test_the_pack_caps_the_spares_share_and_weighs_their_cost(tmp_path: Path) -> None:
    edited = _edited(2, ("aws-train",))
    config = for_stack("prod", resolve(parse_spec(spec_raw(edited))))
    figures = config["gpu-spares-share"]["groupSpares"]["aws-train"]
    assert (figures["spares"], figures["world"]) == (2, 4)
    res = run_stack("prod", lambda cfg: _with_spares(cfg, 2, ("aws-train",)), tmp_path)
    settings = {"groupSpares": config["gpu-spares-share"]["groupSpares"]}
    assert policy_hits(res, "gpu-spares-share", settings) == ["aws-train-asg"]  # 2 spares for 4 nodes: 1 allowed
    assert policy_hits(res, "gpu-spares-share", {**settings, "nodesPerSpare": 2}) == []  # configurable
    from policies.gts_policy.resources import Res
    from policies.gts_policy.rules_cost import spares_share

    [(_, message)] = spares_share([Res(r.type, r.name, r.inputs) for r in res], settings)
    assert "keeps 2 warm spares for a run of 4 nodes, over the cap of 1 (one per 8 nodes)" in message
    assert f"${figures['monthlyUsd']:,.0f}/month against {figures['lossesPerMonth']:.1f} expected member losses" in message


def test_a_kubernetes_jobs_spares_are_pods_beyond_its_world(tmp_path: Path) -> None:
    def edit(config: dict[str, Any]) -> None:
        _group(config, "ali-ack-train")["scaling"] = {"min": 0, "max": 5, "desired": 2, "spares": 1}

    res = run_stack("prod", edit, tmp_path)
    [job] = [r for r in by_type(res, "kubernetes:batch/v1:Job") if r.name.startswith("ali-ack-train")]
    spec = job.inputs["spec"]
    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (3, 3, "Indexed")
    env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env["NNODES"] == "2"  # the world; the third pod waits as a spare
    # The Job succeeds when the run's pods have (a spare still waiting need not end first).
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0-1", "succeededCount": 2}]}
    # Each pod's NODE_RANK is its completion index: the spare's (2) passes the container's first
    # check (`python -m training.contract check`, training/node/entrypoint.sh), one beyond does not.
    trainer = job_containers(job)["trainer"]
    assert c.problems(container_env(trainer, completion_index=2)) == []
    assert c.problems(container_env(trainer, completion_index=3)) == ["NODE_RANK=3 is not below NNODES=2 + SPARES=1"]


@pytest.mark.parametrize("bad", [0, -2, None, "abc", 1.5])
def test_a_bad_nodes_per_spare_is_refused_by_the_rules_config_schema(bad: Any) -> None:
    """The engine checks a rule's config against its schema before the pack runs (`pulumi policy
    validate-config`, `--policy-pack-config`): a share of 0 or less, or not a whole number, is
    refused by name there instead of becoming one spare per node or a crash in the rule."""
    import jsonschema  # type: ignore[import-untyped]  # no stubs installed; the engine validates alike

    from policies.gts_policy.rules import RULES

    [rule] = [r for r in RULES if r.name == "gpu-spares-share"]
    schema = {"type": "object", "properties": rule.schema}
    jsonschema.validate({"nodesPerSpare": 4}, schema)
    with pytest.raises(jsonschema.ValidationError) as caught:
        jsonschema.validate({"nodesPerSpare": bad}, schema)
    assert list(caught.value.absolute_path) == ["nodesPerSpare"]


def test_the_success_policy_goes_where_the_clusters_kubernetes_has_it() -> None:
    """GA in Kubernetes 1.33 (KEP-3998): EKS's version has it, TKE's 1.30 has it behind a gate
    that is off, where the field would be dropped; without spares no Job gets one."""
    from infra import clouds
    from infra.clouds.aws.kubernetes import EKS_VERSION
    from infra.clouds.tencentcloud.kubernetes import TKE_VERSION
    from infra.k8s.job import success_policy

    def minor(version: str) -> tuple[int, int]:
        major, rest = version.split(".", 1)
        return int(major), int(rest.split(".")[0])

    assert clouds.profile("aws").kubernetes_job_success_policy == (minor(EKS_VERSION) >= (1, 33))
    assert clouds.profile("tencentcloud").kubernetes_job_success_policy == (minor(TKE_VERSION) >= (1, 33))

    from dataclasses import replace

    config = stack_values("prod")
    _group(config, "ali-ack-train")["scaling"] = {"min": 0, "max": 5, "desired": 2, "spares": 1}
    stack = resolve(parse_spec(spec_raw(config)))
    rg = stack.group("ali-ack-train")
    on = {cloud: success_policy(replace(rg, group=rg.group.model_copy(update={"cloud": cloud})))
          for cloud in ("aws", "alicloud", "tencentcloud")}  # the same group on each cloud's cluster
    assert [cloud for cloud, policy in on.items() if policy is not None] == ["aws", "alicloud"]
    assert success_policy(stack.group("aws-eks-train")) is None  # no spares, no policy
    rules = on["alicloud"].rules  # type: ignore[union-attr]
    assert [(r.succeeded_indexes, r.succeeded_count) for r in rules] == [("0-1", 2)]  # type: ignore[union-attr]


RESERVATION_WINDOW = {"start": "2026-11-20T08:00:00Z", "end": "2027-01-20T08:00:00Z"}


@pytest.mark.parametrize(("market", "price"), [
    ({"type": "capacity-reservation", **RESERVATION_WINDOW}, "on_demand"),  # above the reservation: on-demand
    ({"type": "capacity-reservation", **RESERVATION_WINDOW, "reservedNodes": 2, "overflow": "spot"}, "spot"),
    ({"type": "on-demand"}, "on_demand"),
    ({"type": "spot"}, "spot"),
])
def test_spares_above_a_reservation_are_priced_in_its_overflow_market_else_on_demand(
        market: dict[str, Any], price: str) -> None:
    config = _edited(1, ("aws-train",))
    _group(config, "aws-train")["market"] = market
    rg = resolve(parse_spec(spec_raw(config))).group("aws-train")
    cost = group_cost(rg)
    node = getattr(rg.prices, price) + rg.prices.disk
    assert rg.prices.spot != rg.prices.on_demand  # the two prices tell the markets apart
    assert cost.spares_monthly_usd == pytest.approx(node * cat.HOURS_PER_MONTH, abs=0.01)


def test_spares_on_a_capacity_block_are_refused_by_key() -> None:
    config = stack_values("dev")  # its AWS training network is in one zone, as a block's must be
    _with_spares(config, 1, ("aws-train",))
    group = _group(config, "aws-train")
    group["market"] = {"type": "capacity-block", "start": "2026-12-20T08:00:00Z", "end": "2026-12-24T08:00:00Z",
                       "reservationId": "cr-0123456789abcdef0"}
    for name in ("gpu", "fallbackTypes"):
        group.pop(name, None)
    group["instanceType"] = "g4dn.2xlarge"
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_raw(config))
    problems = [str(p) for p in caught.value.problems]
    assert any("scaling.spares: 1: a Capacity Block's launch template buys only from the block" in p
               and p.endswith("or set 0") for p in problems), problems
