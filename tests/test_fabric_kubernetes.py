"""Multi-node fabrics (#30) on Kubernetes: prod's EKS training pool on p5.48xlarge with EFA
(interfaces, placement, the EFA device plugin, pods asking for vpc.amazonaws.com/efa) and its
ACK training pool with eRDMA (deployment set, the eRDMA controller add-on, pods asking for
aliyun/erdma), each planned by the real `make plan` code (JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fabric_helpers import GROUPS, of_type, plan
from tests.harness import key, stack_values


@pytest.fixture(scope="module")
def eks_planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """prod with its EKS training pool on p5.48xlarge with fabric: efa."""
    values = stack_values("prod")
    for group in values[GROUPS]:
        if group["name"] == "aws-eks-train":
            group.pop("gpu", None)
            group.update({"instanceType": "p5.48xlarge", "fabric": "efa"})
    values[key("budget")]["monthlyLimitUsd"] = 1_000_000
    proc = plan(tmp_path_factory.mktemp("eks-efa"), values, "eksefa")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


def test_an_eks_efa_pool_gets_the_interfaces_the_device_plugin_and_pods_that_ask_for_efa(
        eks_planned: dict[str, Any]) -> None:
    """EKS: the pool's launch template has one EFA interface per card (security groups on the
    interfaces), the nodes sit in a cluster placement group in one subnet; the EFA device plugin
    (aws-efa-k8s-device-plugin, EKS user guide device-management-efa) runs only on the EFA pools,
    with no service-account token; the training pods request vpc.amazonaws.com/efa and huge pages."""
    lts = [r for r in of_type(eks_planned, "aws:ec2/launchTemplate:LaunchTemplate") if r["name"].startswith("aws-eks-train")]
    assert len(lts) == 1, [r["name"] for r in lts]
    nics = lts[0]["inputs"]["networkInterfaces"]
    assert [n["networkCardIndex"] for n in nics] == list(range(32))
    assert all(n.get("securityGroups") for n in nics) and not lts[0]["inputs"].get("vpcSecurityGroupIds")
    # the training group on every interface (beside the cluster's own group, known after the cluster exists)
    assert all("aws-train-training-sg-id" in n["securityGroups"] for n in nics), nics[0]
    assert lts[0]["inputs"]["placement"]["groupName"], lts[0]["inputs"].get("placement")
    groups = [r for r in of_type(eks_planned, "aws:eks/nodeGroup:NodeGroup") if r["name"].startswith("aws-eks-train")]
    assert groups and all(len(g["inputs"]["subnetIds"]) == 1 for g in groups), [g["inputs"]["subnetIds"] for g in groups]
    assert [r for r in of_type(eks_planned, "aws:ec2/placementGroup:PlacementGroup") if r["inputs"]["strategy"] == "cluster"]
    (plugin,) = [r for r in of_type(eks_planned, "kubernetes:apps/v1:DaemonSet")
                 if r["inputs"]["metadata"]["name"] == "aws-efa-k8s-device-plugin"]
    pod = plugin["inputs"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["hostNetwork"] is True
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["aws-eks-train"]
    jobs = [r for r in of_type(eks_planned, "kubernetes:batch/v1:Job") if "aws-eks-train" in r["name"]]
    assert jobs
    for job in jobs:
        (trainer,) = [c for c in job["inputs"]["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
        limits = trainer["resources"]["limits"]
        assert limits["vpc.amazonaws.com/efa"] == "32" and limits.get("hugepages-2Mi"), limits


def _ack_erdma(market: dict[str, Any]) -> dict[str, Any]:
    values = stack_values("prod")
    for group in values[GROUPS]:
        if group["name"] == "ali-ack-train":
            group.update({"instanceType": "ecs.ebmgn7ex.32xlarge", "fabric": "erdma", "market": market})
    values[key("budget")]["monthlyLimitUsd"] = 1_000_000
    values[key("kubernetes")].pop("queues", None)  # the teams' V100 quota on the pool this replaces
    return values


def test_an_ack_erdma_pool_is_placed_runs_the_controller_and_its_pods_ask_for_erdma(tmp_path: Path) -> None:
    """ACK: an eRDMA pool in a LowLatency deployment set in one vSwitch, the eRDMA controller
    add-on configured through its Helm values (agent.preferDriver ofed, agent.allocateAllDevices;
    alibabacloud-erdma-controller deploy/helm/values.yaml), pods requesting aliyun/erdma."""
    proc = plan(tmp_path, _ack_erdma({"type": "on-demand"}), "ackerdma")
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = json.loads(proc.stdout)
    pools = [r for r in of_type(planned, "alicloud:cs/nodePool:NodePool") if r["name"].startswith("ali-ack-train")]
    assert pools and all(p["inputs"].get("deploymentSetId") and len(p["inputs"]["vswitchIds"]) == 1 for p in pools)
    sets = of_type(planned, "alicloud:ecs/ecsDeploymentSet:EcsDeploymentSet")
    assert sets and all(s["inputs"]["strategy"] == "LowLatency" for s in sets)
    (addon,) = [r for r in of_type(planned, "alicloud:cs/kubernetesAddon:KubernetesAddon")
                if r["inputs"]["name"] == "ack-erdma-controller"]
    assert json.loads(addon["inputs"]["config"]) == {"agent": {"preferDriver": "ofed", "allocateAllDevices": True}}
    jobs = [r for r in of_type(planned, "kubernetes:batch/v1:Job") if "ali-ack-train" in r["name"]]
    assert jobs
    for job in jobs:
        (trainer,) = [c for c in job["inputs"]["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
        assert trainer["resources"]["limits"].get("aliyun/erdma"), trainer["resources"]


def test_a_spot_ack_erdma_pool_is_refused_naming_the_deployment_set_rule(tmp_path: Path) -> None:
    proc = plan(tmp_path, _ack_erdma({"type": "spot", "onDemandBase": 1}), "ackspot")
    assert proc.returncode == 2 and "ali-ack-train" in proc.stderr and "deployment set" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
