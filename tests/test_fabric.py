"""Multi-node fabrics (#30): EFA, eRDMA and HCC per node group, in the catalog, the spec and the
plan. A copy of prod with a 2-node p5.48xlarge group, a 2-node Alibaba eRDMA group and a 2-node
Tencent HCC group is planned by the real `make plan` code (JSON), and the tests read its launch
template, scaling configuration and instances; the bad combinations exit 2 naming the group.
The node's gts-fabric.sh is tests/test_fabric_node.py; EKS and ACK pools are
tests/test_fabric_kubernetes.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra import fabric
from infra.clouds.aws import fleet as aws_fleet
from infra.core.errors import CatalogError, SpecError
from infra.resolve import fabric_plan
from infra.resolve.groups import resolve
from tests.fabric_helpers import GROUPS, fabric_values, of_type, plan, resource
from tests.harness import parse_spec
from tests.harness import spec_raw, stack_values


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    proc = plan(tmp_path_factory.mktemp("fabric"), fabric_values())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


# ---------------------------------------------------------------------------- the catalog

def test_fabric_data_has_the_sources_counts() -> None:
    data = fabric.load()
    assert data[("aws", "p4d.24xlarge")].devices == 4 and data[("aws", "p5.48xlarge")].devices == 32
    assert data[("aws", "p5en.48xlarge")].devices == 16
    assert all(f.source for f in data.values())
    p5 = aws_fleet.interface_types(data[("aws", "p5.48xlarge")])
    assert p5[0] == "efa" and p5[4] == "efa" and p5[1] == "efa-only" and p5.count("efa") == 8


def test_fabric_file_checks_refuse_bad_rows(tmp_path: Path) -> None:
    text = fabric.PATH.read_text()
    bad = tmp_path / "fabric.csv"
    bad.write_text(text.replace("aws,p4d.24xlarge,efa,4,4", "aws,p4d.24xlarge,erdma,4,4"))
    with pytest.raises(CatalogError, match="aws types have fabric 'efa'"):
        fabric.load_file(bad)
    bad.write_text(text.replace("aws,p4d.24xlarge,efa,4,4", "aws,p4d.24xlarge,efa,4,3"))
    with pytest.raises(CatalogError, match="interfaces must equal devices"):
        fabric.load_file(bad)
    bad.write_text(text.replace("aws,p4d.24xlarge,efa", "aws,p9.24xlarge,efa"))
    with pytest.raises(CatalogError, match="not in gpu_catalog.csv"):
        fabric.load_file(bad)


# ---------------------------------------------------------------------------- AWS

def test_p5_launch_template_has_one_efa_interface_per_card(planned: dict[str, Any]) -> None:
    lt = resource(planned, "aws:ec2/launchTemplate:LaunchTemplate", "aws-efa-lt")
    nics = lt["networkInterfaces"]
    assert [n["networkCardIndex"] for n in nics] == list(range(32))
    assert [n["deviceIndex"] for n in nics] == [0] + [1] * 31
    assert [n["interfaceType"] for n in nics] == ["efa" if i % 4 == 0 else "efa-only" for i in range(32)]
    groups = {tuple(n["securityGroups"]) for n in nics}
    # The same groups on every interface: the network's VM group, (a multi-node group) its
    # rendezvous store's client group (issue 27) and its run's own group (issue 41), nothing at
    # the template's top level.
    assert len(groups) == 1 and next(iter(groups))[0] == "aws-train-vm-sg-id", groups
    assert list(next(iter(groups))[1:]) == ["prod-rdzv-aws-efa-clients-id", "aws-efa-run-sg-id"], groups
    assert not lt.get("vpcSecurityGroupIds")
    assert not lt.get("vpcSecurityGroupIds"), "interfaces carry the groups; the template must not"
    assert not any(n.get("associatePublicIpAddress") for n in nics) and not any(n.get("subnetId") for n in nics)
    asg = resource(planned, "aws:autoscaling/group:Group", "aws-efa-asg")
    assert asg["placementGroup"] and len(asg["vpcZoneIdentifiers"]) == 1, "one zone, one cluster placement group"
    pg = [r for r in of_type(planned, "aws:ec2/placementGroup:PlacementGroup") if r["name"] == "aws-efa-pg"]
    assert pg and pg[0]["inputs"]["strategy"] == "cluster"


def test_prod_p4d_group_gets_efa_by_auto_and_its_run_group_admits_it(planned: dict[str, Any]) -> None:
    lt = resource(planned, "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    assert [n["interfaceType"] for n in lt["networkInterfaces"]] == ["efa", "efa-only", "efa-only", "efa-only"]
    ingress = resource(planned, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "aws-train-run-self")
    egress = resource(planned, "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule", "aws-train-run-self-egress")
    for rule in (ingress, egress):
        assert rule["ipProtocol"] == "-1" and rule["referencedSecurityGroupId"] == rule["securityGroupId"]
        assert rule["securityGroupId"] == "aws-train-run-sg-id"
    assert "aws-train-run-sg-id" in lt["networkInterfaces"][0]["securityGroups"]
    # No other group's rule to itself goes both ways: the network's groups carry no EFA egress.
    names = [r["name"] for r in of_type(planned, "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")]
    assert not [n for n in names if n.endswith("-self-egress") and "-run-" not in n], names


def test_single_node_and_inference_groups_keep_one_plain_interface(planned: dict[str, Any]) -> None:
    for lt in of_type(planned, "aws:ec2/launchTemplate:LaunchTemplate"):
        if lt["name"] in ("aws-efa-lt", "aws-train-lt"):
            continue
        assert not lt["inputs"].get("networkInterfaces"), lt["name"]


def test_plan_cost_shows_fabric_and_placement(planned: dict[str, Any]) -> None:
    groups = {g["name"]: g for g in planned["cost"]["node_groups"]}
    assert (groups["aws-efa"]["fabric"], groups["aws-efa"]["fabric_interfaces"]) == ("efa", 32)
    assert groups["aws-efa"]["placement"] == "cluster placement group"
    assert groups["aws-efa"]["placement_monthly_usd"] == 0.0
    assert groups["aws-eks-infer"]["fabric"] == "none"
    assert "placement_monthly_usd" in planned["cost"]["by_cloud"]["aws"]


# ---------------------------------------------------------------------------- the spec

def spec_with(edit: dict[str, Any], index: int = -1, values: dict[str, Any] | None = None) -> Any:
    values = values or fabric_values()
    values[GROUPS][index].update(edit)
    return parse_spec(spec_raw(values))


@pytest.mark.parametrize("edit, words", [
    ({"instanceType": "g5.48xlarge", "fabric": "efa"}, ["aws-efa", "g5.48xlarge has no EFA", "p5.48xlarge"]),
    ({"fabric": "erdma"}, ["aws-efa", "'erdma' is not a fabric of AWS", "'efa'"]),
    ({"fallbackTypes": ["p4d.24xlarge"]}, ["aws-efa", "p4d.24xlarge has 4 interfaces", "p5.48xlarge 32 / 32",
                                           "same counts"]),
])
def test_bad_fabric_combinations_name_the_group_type_and_fix(edit: dict[str, Any], words: list[str]) -> None:
    values = fabric_values()
    index = next(i for i, g in enumerate(values[GROUPS]) if g["name"] == "aws-efa")
    with pytest.raises(SpecError) as err:
        spec_with(edit, index, values)
    text = str(err.value)
    assert f"nodeGroups[{index}]" in text
    for word in words:
        assert word in text, text


def test_tke_pool_cannot_take_hcc() -> None:
    values = fabric_values()
    index = next(i for i, g in enumerate(values[GROUPS]) if g["name"] == "tc-hcc")
    with pytest.raises(SpecError, match=rf"nodeGroups\[{index}\]\.fabric.*TKE node pools cannot"):
        spec_with({"kind": "kubernetes", "fabric": "hcc", "scaling": {"min": 2, "max": 2, "desired": 2}}, index,
                  values)


def test_fabric_on_a_type_without_one_exits_2_from_the_plan(tmp_path: Path) -> None:
    values = fabric_values()
    values[GROUPS][-1].update({"instanceType": "GT4.41XLARGE948", "fabric": "hcc"})
    proc = plan(tmp_path, values, "bad")
    assert proc.returncode == 2, proc.stderr
    assert "tc-hcc" in proc.stderr and "GT4.41XLARGE948 has no HCC RDMA" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_fabric_none_on_a_multi_node_fabric_group_is_an_advisory_with_its_cost() -> None:
    spec = spec_with({"fabric": "none"}, next(i for i, g in enumerate(fabric_values()[GROUPS])
                                                 if g["name"] == "aws-efa"))
    stack = resolve(spec)
    assert stack.group("aws-efa").fabric is None
    (advice,) = [a for a in fabric_plan.advisories(stack) if a["resource"] == "aws-efa"]
    assert advice["enforcement"] == "advisory"
    assert "32 EFA" in advice["message"] and "3200 Gbps" in advice["message"] and "$55.04/h" in advice["message"]


def test_auto_leaves_single_node_and_fabricless_types_alone() -> None:
    stack = resolve(parse_spec(spec_raw(stack_values("prod"))))
    with_fabric = {g.name: g.fabric.fabric for g in stack.groups if g.fabric}
    assert with_fabric == {"aws-train": "efa"}, "prod: only the p4d fleet's types have a fabric and run multi-node"


# ---------------------------------------------------------------------------- Alibaba and Tencent

def test_erdma_group_is_a_scaling_configuration_with_a_high_performance_primary_eni(planned: dict[str, Any]) -> None:
    config = resource(planned, "alicloud:ess/scalingConfiguration:ScalingConfiguration", "ali-erdma-config")
    (nic,) = config["networkInterfaces"]
    assert (nic["instanceType"], nic["networkInterfaceTrafficMode"]) == ("Primary", "HighPerformance")
    # the network's VM group, its rendezvous store's client group (issue 27) and its run's own
    # group (issue 41), as on the other paths
    assert nic["securityGroupIds"] == ["ali-train-vm-sg-id", "prod-rdzv-ali-erdma-clients-id", "ali-erdma-run-sg-id"]
    assert "securityGroupId" not in config and "securityGroupIds" not in config, "the ENIs carry the group"
    assert config["active"] is True and config["systemDiskEncrypted"] is True
    group = resource(planned, "alicloud:ess/scalingGroup:ScalingGroup", "ali-erdma-ess")
    assert group["vswitchIds"] == ["ali-train-cn-hangzhou-h-id"], "one zone"
    assert not group.get("launchTemplateId"), "a launch template cannot set the traffic mode"
    names = [r["name"] for r in of_type(planned, "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate")]
    assert "ali-erdma-lt" not in names and "ali-train-lt" in names, "only the eRDMA group changes"


def test_hcc_group_is_instances_in_an_hcc_cluster_in_one_zone(planned: dict[str, Any]) -> None:
    hcc = resource(planned, "tencentcloud:Cvm/hpcCluster:HpcCluster", "tc-hcc-hcc")
    assert hcc["zone"] == "ap-guangzhou-3"
    for i in range(2):
        node = resource(planned, "tencentcloud:Instance/instance:Instance", f"tc-hcc-{i}")
        assert node["hpcClusterId"] == "tc-hcc-hcc-id" and node["availabilityZone"] == "ap-guangzhou-3"
        assert node["instanceType"] == "HCCPNV4sne.32XLARGE1280" and node["allocatePublicIp"] is False
    groups = [r["name"] for r in of_type(planned, "tencentcloud:As/scalingGroup:ScalingGroup")]
    assert "tc-hcc-asg" not in groups, "AS cannot place instances in an HCC cluster through the provider"
    cost = {g["name"]: g for g in planned["cost"]["node_groups"]}
    assert (cost["tc-hcc"]["fabric"], cost["tc-hcc"]["fabric_devices"]) == ("hcc", 8)
    assert cost["ali-erdma"]["placement"].startswith("one vSwitch"), "no deployment set on an ESS configuration"


def test_hcc_group_must_be_a_fixed_count() -> None:
    values = fabric_values()
    index = next(i for i, g in enumerate(values[GROUPS]) if g["name"] == "tc-hcc")
    with pytest.raises(SpecError, match=rf"nodeGroups\[{index}\]\.scaling.*tc-hcc.*min = max = 4"):
        spec_with({"scaling": {"min": 2, "max": 4}}, index, values)
