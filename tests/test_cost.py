"""Cost arithmetic, checked against hand computation from the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from infra.core.catalog import load_catalog
from infra.model.spec import StackSpec
from infra.resolve import cost
from infra.resolve.groups import resolve
from tests.harness import parse_spec as parse
from tests.harness import key, spec_raw, stack_values

HOURS = 730.0
# p4d.24xlarge in the dev network's region (us-east-1): its on-demand price and spot discount there
_P4D = load_catalog().priced("aws", "p4d.24xlarge", "us-east-1")
assert _P4D is not None
P4D, P4D_SPOT = _P4D.price_ondemand, _P4D.spot_discount


def _spec(stack: str = "dev", **edits: Any) -> StackSpec:
    values = stack_values(stack)
    for name, value in edits.items():
        values[key(name)] = value
    return parse(spec_raw(values))


def _one_group(group: dict[str, Any], scratch_gb: int = 0) -> StackSpec:
    values = stack_values("dev")
    values[key("nodeGroups")] = [group]
    values[key("storage")]["scratch"] = {"sizeGb": scratch_gb}
    return parse(spec_raw(values))


BASE = {"name": "grp", "cloud": "aws", "network": "aws-train", "instanceType": "p4d.24xlarge"}


def test_on_demand_always_on() -> None:
    spec = _one_group({**BASE, "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}})
    g = cost.group_cost(resolve(spec).groups[0])
    assert g.hourly_usd == pytest.approx(2 * P4D)
    assert g.monthly_usd == pytest.approx(2 * P4D * HOURS, abs=0.01)
    assert g.on_demand_monthly_usd == pytest.approx(g.monthly_usd, abs=0.01)


def test_spot_with_on_demand_base() -> None:
    spec = _one_group({**BASE, "scaling": {"min": 3, "max": 3}, "market": {"type": "spot", "onDemandBase": 1}})
    g = cost.group_cost(resolve(spec).groups[0])
    spot = P4D * (1 - P4D_SPOT)
    assert g.hourly_usd == pytest.approx(P4D + 2 * spot)
    assert g.on_demand_monthly_usd == pytest.approx(3 * P4D * HOURS, abs=0.01)


def test_spot_max_price_caps_the_spot_price() -> None:
    spec = _one_group({**BASE, "scaling": {"min": 1, "max": 1}, "market": {"type": "spot", "spotMaxPriceUsd": 5.0}})
    assert cost.group_cost(resolve(spec).groups[0]).hourly_usd == pytest.approx(5.0)


def test_schedule_duty_cycle() -> None:
    # 2 nodes on weekdays 08:00-20:00 UTC, 0 otherwise: 5 x 12 h of 168 h.
    spec = _one_group({**BASE, "scaling": {"min": 0, "max": 2, "desired": 0}, "market": {"type": "on-demand"},
                       "schedule": [{"name": "up", "cron": "0 8 * * 1-5", "desired": 2},
                                    {"name": "down", "cron": "0 20 * * 1-5", "desired": 0}]})
    g = cost.group_cost(resolve(spec).groups[0])
    assert g.average_nodes == pytest.approx(2 * 60 / 168, abs=1e-4)
    assert g.peak_nodes == 2
    assert g.hourly_usd == pytest.approx(2 * 60 / 168 * P4D, rel=1e-4)
    assert g.peak_hourly_usd == pytest.approx(2 * P4D)


def test_reserved_pays_peak_around_the_clock() -> None:
    spec = _one_group({**BASE, "scaling": {"min": 0, "max": 2, "desired": 0}, "market": {"type": "reserved"},
                       "schedule": [{"name": "up", "cron": "0 8 * * 1-5", "desired": 2},
                                    {"name": "down", "cron": "0 20 * * 1-5", "desired": 0}]})
    g = cost.group_cost(resolve(spec).groups[0])
    assert g.hourly_usd == pytest.approx(2 * P4D * (1 - 0.40), abs=1e-4)  # the cost model rounds to 4 places


def test_cny_converted_and_data_disk_added() -> None:
    group = {"name": "grp", "cloud": "tencentcloud", "network": "tc-train", "instanceType": "GN7.2XLARGE32",
             "workload": "inference", "scaling": {"min": 1, "max": 1}, "market": {"type": "on-demand"}}
    spec = _one_group(group, scratch_gb=100)
    g = cost.group_cost(resolve(spec).groups[0])
    node = 8.68 / 7.2
    disk = 100 * 1.0 / 7.2 / HOURS
    assert g.hourly_usd == pytest.approx(node + disk, rel=1e-4)
    assert g.disk_monthly_usd == pytest.approx(100 / 7.2, abs=0.01)


def test_stack_totals_add_up() -> None:
    spec = _spec("prod")
    total = cost.stack_cost(resolve(spec))
    groups = total["node_groups"]
    for cloud, c in total["by_cloud"].items():
        mine = sum(g["monthly_usd"] for g in groups if g["cloud"] == cloud)
        fixed = (c["storage_monthly_usd"] + c["clusters_monthly_usd"] + c["nat_monthly_usd"] + c["registry_monthly_usd"]
                 + c["rendezvous_monthly_usd"] + c["shared_fs_monthly_usd"])
        assert c["monthly_usd"] == pytest.approx(mine + fixed, abs=0.05)
    assert total["monthly_usd"] == pytest.approx(sum(c["monthly_usd"] for c in total["by_cloud"].values()), abs=0.05)
    assert total["hourly_usd"] == pytest.approx(total["monthly_usd"] / HOURS, abs=0.01)
    assert total["monthly_usd"] < total["on_demand_monthly_usd"]


def test_clusters_add_their_control_plane_and_system_pool() -> None:
    """prod has one cluster per cloud. EKS: $0.10/h control plane + 2 x m6i.large at $0.096/h
    (AWS price list, us-east-1); ACK and TKE: estimates in CNY at 7.2 per USD."""
    total = cost.stack_cost(resolve(_spec("prod")))["by_cloud"]
    assert total["aws"]["clusters_monthly_usd"] == pytest.approx((0.10 + 2 * 0.096) * HOURS, abs=0.01)
    assert total["alicloud"]["clusters_monthly_usd"] == pytest.approx((0.64 + 2 * 0.55) / 7.2 * HOURS, abs=0.01)
    assert total["tencentcloud"]["clusters_monthly_usd"] == pytest.approx((0.50 + 2 * 0.90) / 7.2 * HOURS, abs=0.01)
    dev = cost.stack_cost(resolve(_spec("dev")))["by_cloud"]  # no Kubernetes groups: no cluster cost
    assert all(c["clusters_monthly_usd"] == 0 for c in dev.values())


def test_nat_gateways_are_counted() -> None:
    """prod: two AWS networks with NAT at $0.045/h plus $0.005/h for the public IPv4 address."""
    total = cost.stack_cost(resolve(_spec("prod")))["by_cloud"]
    assert total["aws"]["nat_monthly_usd"] == pytest.approx(2 * (0.045 + 0.005) * HOURS, abs=0.01)
    assert total["tencentcloud"]["nat_monthly_usd"] == pytest.approx(2 * (0.50 + 0.02) / 7.2 * HOURS, abs=0.01)


def test_the_trainer_image_registry_is_counted_where_the_stack_builds_the_image() -> None:
    """ECR: storage only ($0.10/GB-month x 12 GB); ACR EE Basic and TCR Basic: their edition's
    monthly fee (estimates, CNY at 7.2). None where a prebuilt image is named for the cloud."""
    total = cost.stack_cost(resolve(_spec("prod")))["by_cloud"]
    assert total["aws"]["registry_monthly_usd"] == pytest.approx(0.10 * 12, abs=0.01)
    assert total["alicloud"]["registry_monthly_usd"] == pytest.approx(780 / 7.2, abs=0.01)
    values = stack_values("prod")
    values[key("training")]["prebuiltImages"] = {
        "alicloud": "registry.example.com/team/trainer@sha256:" + "a" * 64}
    prebuilt = cost.stack_cost(resolve(parse(spec_raw(values))))["by_cloud"]
    assert prebuilt["alicloud"]["registry_monthly_usd"] == 0
    assert prebuilt["alicloud"]["monthly_usd"] == pytest.approx(total["alicloud"]["monthly_usd"] - 780 / 7.2, abs=0.05)


def test_rendezvous_stores_are_counted_per_network_with_a_multi_node_vm_group() -> None:
    """prod: one store per cloud (its VM group spans up to 4 nodes); AWS t3.medium $0.0416/h."""
    total = cost.stack_cost(resolve(_spec("prod")))["by_cloud"]
    assert total["aws"]["rendezvous_monthly_usd"] == pytest.approx(0.0416 * HOURS, abs=0.01)
    assert total["alicloud"]["rendezvous_monthly_usd"] == pytest.approx(0.55 / 7.2 * HOURS, abs=0.01)
    single = _spec("dev")
    values = stack_values("dev")
    for g in values[key("nodeGroups")]:
        g["scaling"]["max"] = 1
    single = parse(spec_raw(values))
    assert all(c["rendezvous_monthly_usd"] == 0 for c in cost.stack_cost(resolve(single))["by_cloud"].values())
