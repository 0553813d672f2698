"""What the clouds would refuse at the first `pulumi up`, or accept and then never run, checked on
what the program registers. Each test names the provider source of the constraint it encodes;
each fails when its fix is reverted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.core import catalog as cat
from infra.core.errors import SpecError
from infra.plan.engine import DuplicateUrn, Registered, run_program
from infra.plan.invokes import COMPUTED, INVOKES
from infra.stack.stackfile import StackConfig
from tests.harness import parse_spec as parse
from tests.harness import ROOT, by_type, key, run_stack, shipped, spec_raw, stack_values

CONSTRAINTS = cat.load_constraints()


def prod() -> list[Registered]:
    return list(shipped("prod"))


def named(resources: list[Registered], name: str) -> Registered:
    (found,) = [r for r in resources if r.name == name]
    return found


def _problems(stack: str, edit: Any) -> str:
    values = stack_values(stack)
    edit(values)
    with pytest.raises(SpecError) as info:
        parse(spec_raw(values))
    return str(info.value)


# ----------------------------------------------------------------------------------- AWS

def test_instance_tags_in_imds_have_no_slash() -> None:
    """AWS EC2 user guide, work-with-tags-in-IMDS: with instance tags in the metadata service, a
    key with `/` or a space fails the launch."""
    pattern = re.compile(CONSTRAINTS["imdsTagKey"]["pattern"])
    res = prod()
    checked = 0
    for lt in by_type(res, "aws:ec2/launchTemplate:LaunchTemplate"):
        if lt.inputs["metadataOptions"].get("instanceMetadataTags") != "enabled":
            continue
        for spec in lt.inputs["tagSpecifications"]:
            assert all(pattern.match(k) for k in spec["tags"]), (lt.name, list(spec["tags"]))
            checked += 1
    for asg in by_type(res, "aws:autoscaling/group:Group"):
        assert all(pattern.match(t["key"]) for t in asg.inputs["tags"] if t["propagateAtLaunch"]), asg.name
    assert checked >= 3
    message = _problems("dev", lambda v: v[key("tags")].__setitem__("team/ml", "x"))
    assert "tags.team/ml" in message and "no spaces or /" in message


def test_eks_nodes_keep_pods_off_the_node_role() -> None:
    """EKS user guide, al2023 and pod-identities: hop limit 1 keeps pods from the node role's IMDS
    credentials; pods get their own through the Pod Identity agent."""
    res = prod()
    for name in ("aws-eks-train-lt", "aws-eks-infer-lt"):
        options = named(res, name).inputs["metadataOptions"]
        assert options["httpPutResponseHopLimit"] == 1 and options["httpTokens"] == "required"
        assert options.get("instanceMetadataTags") != "enabled"  # EKS tags nodes with `/` keys
    addons = sorted(a.inputs["addonName"] for a in by_type(res, "aws:eks/addon:Addon"))
    # EFS for the Jobs, vpc-cni for NetworkPolicy enforcement (issue 27; tests/test_tenancy_k8s.py), the
    # node monitoring agent for GPU node repair (issue 31)
    assert addons == ["aws-efs-csi-driver", "eks-node-monitoring-agent", "eks-pod-identity-agent", "vpc-cni"]


def test_eks_autoscaler_has_its_own_role_by_pod_identity() -> None:
    """kubernetes/autoscaler cluster-autoscaler/cloudprovider/aws: auto-discovery tags, IAM policy,
    RBAC; EKS user guide pod-id-role: trust pods.eks.amazonaws.com with AssumeRole + TagSession."""
    res = prod()
    associations = by_type(res, "aws:eks/podIdentityAssociation:PodIdentityAssociation")
    (association,) = [a for a in associations if a.inputs["namespace"] == "kube-system"]
    assert association.inputs["serviceAccount"] == "cluster-autoscaler"
    assert association.options["dependencies"], "created after the agent add-on"
    role = next(r for r in by_type(res, "aws:iam/role:Role") if r.name.endswith("-ca-role"))
    trust = json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]
    assert trust["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert set(trust["Action"]) == {"sts:AssumeRole", "sts:TagSession"}
    (deploy,) = [d for d in by_type(res, "kubernetes:apps/v1:Deployment") if d.name.endswith("-ca-deploy")]
    container = deploy.inputs["spec"]["template"]["spec"]["containers"][0]
    assert any(a.startswith("--node-group-auto-discovery=asg:tag=k8s.io/cluster-autoscaler/enabled") for a in container["command"])
    assert {"name": "AWS_REGION", "value": "us-east-1"} in container["env"]
    # Scale from zero after a group has had nodes: label and taint templates on each GPU group's ASG.
    template = [t for t in by_type(res, "aws:autoscaling/tag:Tag") if t.name.startswith("aws-eks-train-spot-template")]
    keys = {t.inputs["tag"]["key"] for t in template}
    assert "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu" in keys
    assert "k8s.io/cluster-autoscaler/node-template/label/gpu-training-stack/node-group" in keys
    assert all(t.inputs["tag"]["propagateAtLaunch"] is False for t in template)


def test_eks_api_open_only_to_the_listed_cidrs() -> None:
    """EKS user guide, cluster-endpoint: public access CIDRs, private access kept on."""
    (cluster,) = by_type(prod(), "aws:eks/cluster:Cluster")
    config = cluster.inputs["vpcConfig"]
    assert config["endpointPrivateAccess"] is True and config["endpointPublicAccess"] is True
    assert config["publicAccessCidrs"] == ["203.0.113.0/24"]
    assert cluster.inputs["version"] == "1.35"


# ------------------------------------------------------------------------------- Kubernetes

def test_training_jobs_are_not_awaited() -> None:
    """pulumi_kubernetes batch/v1/Job.py: a Job is awaited until Complete, 10 minutes at most;
    `pulumi.com/skipAwait` turns that off."""
    jobs = by_type(prod(), "kubernetes:batch/v1:Job")
    assert len(jobs) == 3
    assert all(j.inputs["metadata"]["annotations"]["pulumi.com/skipAwait"] == "true" for j in jobs)


def test_every_cluster_has_an_untainted_system_pool_and_node_agents() -> None:
    """aws/containers-roadmap#1389 (CoreDNS cannot schedule on tainted nodes only); ACK node pool
    doc (autoscaled nodes repel system pods). DCGM and node exporters run on every GPU node."""
    res = prod()
    eks_system = named(res, "prod-aws-train-system")
    assert eks_system.inputs["capacityType"] == "ON_DEMAND" and not eks_system.inputs.get("taints")
    ack_system = named(res, "prod-ali-train-system")
    assert "scalingConfig" not in ack_system.inputs and not ack_system.inputs.get("taints")
    tke_system = named(res, "prod-tc-train-system")
    assert tke_system.inputs["enableAutoScale"] is False and not tke_system.inputs.get("taints")
    daemonsets = [d.inputs["metadata"]["name"] for d in by_type(res, "kubernetes:apps/v1:DaemonSet")]
    assert daemonsets.count("dcgm-exporter") == 3 and daemonsets.count("node-exporter") == 3
    for ds in by_type(res, "kubernetes:apps/v1:DaemonSet"):
        pod = ds.inputs["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_pod_networks_are_admitted_on_ack_and_tke_nodes() -> None:
    """ACK on Terway: pods take the nodes' ENIs' secondary addresses (the group's own rule admits
    them; no pod range outside the VPC); TKE "Security group settings" (the container pod network
    must be open: every port but the exporters', infra/model/scrape.py)."""
    res = prod()
    ack = [r for r in by_type(res, "alicloud:ecs/securityGroupRule:SecurityGroupRule") if r.name == "prod-ali-train-pods"]
    assert not ack
    rules = named(res, "tc-train-training-rules").inputs["ingresses"]
    assert any(r.get("cidrBlock") == "172.20.0.0/16" and r.get("port") == "1-9099" for r in rules)


def test_ack_autoscaling_is_switched_on_and_pools_fit_its_mark_limit() -> None:
    """ACK "Enable node auto scaling": the cluster-level switch, the service role, and fewer than
    12 tags + taints + labels on an autoscaled pool."""
    res = prod()
    (config,) = by_type(res, "alicloud:cs/autoscalingConfig:AutoscalingConfig")
    assert config.inputs["scaleUpFromZero"] is True
    pool = named(res, "ali-ack-train-pool")
    marks = len(pool.inputs["tags"]) + len(pool.inputs["labels"]) + len(pool.inputs["taints"])
    assert marks <= CONSTRAINTS["ackAutoscalingPoolMarks"]["max"]
    message = _problems("prod", lambda v: v[key("tags")].update({f"extra{i}": "x" for i in range(4)}))
    assert "ACK GPU pools would carry" in message
    autoscaler_role = [r for r in by_type(res, "alicloud:ram/role:Role") if r.inputs["roleName"] == "AliyunCSManagedAutoScalerRole"]
    assert len(autoscaler_role) == 1  # prod manages the account's settings (clouds.alicloud.accountSettings)


def test_ack_api_stays_private() -> None:
    (cluster,) = by_type(prod(), "alicloud:cs/managedKubernetes:ManagedKubernetes")
    assert cluster.inputs["slbInternetEnabled"] is False


# ----------------------------------------------------------------------------------- Tencent

def test_tencent_spot_always_carries_a_price() -> None:
    """terraform-provider-tencentcloud resource_tc_kubernetes_node_pool.go / as_scaling_config:
    "SPOTPAID instance must set spot_instance_type and spot_max_price at the same time"."""
    res = prod()
    configs = [r.inputs for r in by_type(res, "tencentcloud:As/scalingConfig:ScalingConfig")]
    configs += [r.inputs["autoScalingConfig"] for r in by_type(res, "tencentcloud:Kubernetes/nodePool:NodePool")]
    spot = [c for c in configs if c.get("instanceChargeType") == "SPOTPAID"]
    assert len(spot) == 2
    for c in spot:
        assert c["spotInstanceType"] == "one-time" and float(c["spotMaxPrice"]) > 0


def test_tke_endpoint_opens_after_the_pools_and_the_cluster_does_not_wait() -> None:
    """tencentcloud kubernetes_cluster_endpoint doc: create the endpoint after the node pools;
    an endpoint on the cluster itself waits for a worker that cannot exist yet."""
    res = prod()
    (cluster,) = by_type(res, "tencentcloud:Kubernetes/cluster:Cluster")
    assert not {"clusterInternet", "clusterIntranet", "clusterIntranetSubnetId"} & set(cluster.inputs)
    assert "clusterIntranet" in cluster.options["ignoreChanges"]
    (endpoint,) = by_type(res, "tencentcloud:Kubernetes/clusterEndpoint:ClusterEndpoint")
    pools = {p.urn for p in by_type(res, "tencentcloud:Kubernetes/nodePool:NodePool")}
    assert len(pools) == 3 and pools <= set(endpoint.options["dependencies"])
    assert endpoint.inputs["clusterInternet"] is True and endpoint.inputs["clusterInternetSecurityGroup"]
    (rules,) = [r for r in by_type(res, "tencentcloud:Security/groupRuleSet:GroupRuleSet") if r.name.endswith("-api-rules")]
    assert [(i["cidrBlock"], i["port"]) for i in rules.inputs["ingresses"]] == [("203.0.113.0/24", "443")]
    for pool in by_type(res, "tencentcloud:Kubernetes/nodePool:NodePool"):
        assert pool.inputs["nodeOs"] == "ubuntu22.04x86_64"  # python3 >= 3.7 for the node scripts
        assert len(pool.inputs["name"]) <= CONSTRAINTS["nameLimits"]["tkeNodePool"]["max"]


def test_tencent_budget_counts_this_stack_only() -> None:
    (budget,) = by_type(prod(), "tencentcloud:Billing/budget:Budget")
    assert budget.inputs["dimensionsRange"]["tags"] == [{"tagKey": "env", "tagValues": ["prod"]}]
    assert cat.feature_unavailable("tencentcloud", "budgetRecipients")


# ----------------------------------------------------------------------------- schedules

def test_scheduled_tasks_are_renewed_not_left_to_expire() -> None:
    """Alibaba ESS: RecurrenceEndTime at most 365 days after creation; Tencent AS: end_time with
    every recurrence. The end moves monthly and replaces the task."""
    res = list(shipped("dev"))
    tasks = by_type(res, "alicloud:ess/scheduledTask:ScheduledTask") + by_type(res, "tencentcloud:As/schedule:Schedule")
    assert len(tasks) == 4
    for task in tasks:
        field = "recurrenceEndTime" if "ess" in task.type else "endTime"
        assert field not in task.options["ignoreChanges"] and field in task.options["replaceOnChanges"]
        assert task.options["deleteBeforeReplace"] is True
    for task in by_type(res, "alicloud:ess/scheduledTask:ScheduledTask"):
        name = task.inputs["scheduledTaskName"]
        assert name.startswith("dev-") and len(name) <= CONSTRAINTS["nameLimits"]["essScheduledTask"]["max"]


def test_long_names_still_fit_the_clouds_limits(tmp_path: Path) -> None:
    """ESS task names 2-40 and unique per region; TKE pool names at most 25."""
    def edit(v: dict[str, Any]) -> None:
        v[key("env")] = v[key("tags")]["env"] = "prod-team-with-a-long-name"
        for g in v[key("nodeGroups")]:
            for i, a in enumerate(g.get("schedule", [])):
                a["name"] = f"action-with-a-really-long-name{i}"
    res = run_stack("prod", edit, tmp_path)
    for task in by_type(res, "alicloud:ess/scheduledTask:ScheduledTask"):
        assert len(task.inputs["scheduledTaskName"]) <= 40
    for pool in by_type(res, "tencentcloud:Kubernetes/nodePool:NodePool"):
        assert len(pool.inputs["name"]) <= 25


# ------------------------------------------------------------------ what users can write

@pytest.mark.parametrize("what,stack,edit,expected", [
    ("transit on AWS", "prod", lambda v: v[key("peerings")][0].__setitem__("via", "transit"),
     ["peerings[0].via", "'transit' on AWS", "Transit Gateway"]),
    ("transit on Alibaba", "prod", lambda v: v[key("peerings")][2].__setitem__("via", "transit"),
     ["peerings[2].via", "'transit' on Alibaba Cloud", "CEN"]),
    ("schedule on ACK", "prod", lambda v: v[key("nodeGroups")][4].__setitem__(
        "schedule", [{"name": "night", "cron": "0 12 * * *", "desired": 0}]),
     ["nodeGroups[4].schedule", "Alibaba Cloud Kubernetes group"]),
    ("schedule on TKE", "prod", lambda v: v[key("nodeGroups")][6].__setitem__(
        "schedule", [{"name": "night", "cron": "0 12 * * *", "desired": 0}]),
     ["nodeGroups[6].schedule", "Tencent Cloud Kubernetes group"]),
    ("reserved bucket prefix", "dev", lambda v: v[key("storage")].__setitem__("bucketPrefix", "xn--gts"),
     ["storage.bucketPrefix", "starts with 'xn--', which is reserved"]),
    ("AWS VPC too large", "dev", lambda v: v[key("networks")][0].update(
        cidr="10.0.0.0/8", subnets=[{"zone": "us-east-1a", "cidr": "10.0.0.0/20"}]),
     ["networks[0].cidr", "a AWS VPC must be /16 to /28"]),
    ("Alibaba vSwitch too small", "dev", lambda v: v[key("networks")][1]["subnets"][0].__setitem__("cidr", "10.40.0.0/30"),
     ["networks[1].subnets[0].cidr", "subnet must be /16 to /29"]),
    ("AWS reserved tag prefix", "dev", lambda v: v[key("tags")].__setitem__("aws:team", "x"),
     ["tags.aws:team", "'aws:'"]),
    ("Alibaba reserved tag value", "dev", lambda v: v[key("tags")].__setitem__("owner", "aliyun-team"),
     ["tags.owner", "value 'aliyun-team' starts with 'aliyun'"]),
    ("Tencent reserved tag key", "dev", lambda v: v[key("tags")].__setitem__("project", "x"),
     ["tags.project", "Tencent Cloud reserves"]),
    ("one pair peered twice", "prod", lambda v: v[key("peerings")].append(
        {"name": "again", "requester": "aws-data", "accepter": "aws-train"}),
     ["peerings[6]", "already linked by peerings[0]"]),
    ("two subnets in one zone", "dev", lambda v: v[key("networks")][0]["subnets"].append(
        {"zone": "us-east-1a", "cidr": "10.10.16.0/20"}),
     ["networks[0].subnets[1].zone", "already has subnets[0]"]),
    ("schedule names that join into one", "dev", lambda v: (
        v[key("nodeGroups")][0]["schedule"][0].__setitem__("name", "bb-cc"),
        v[key("nodeGroups")].append({**v[key("nodeGroups")][0], "name": "aws-train-bb",
                                     "schedule": [{"name": "cc", "cron": "0 1 * * *", "desired": 0}]})),
     ["makes the resource name 'aws-train-bb-cc'"]),
    ("API open to the internet in halves", "prod", lambda v: v[key("kubernetes")].__setitem__(
        "apiAccessCidrs", ["0.0.0.0/1", "128.0.0.0/1"]), ["kubernetes.apiAccessCidrs", "open the API servers to the internet"]),
    ("API from a private range", "prod", lambda v: v[key("kubernetes")].__setitem__(
        "apiAccessCidrs", ["10.0.0.0/24"]), ["kubernetes.apiAccessCidrs[0]", "not a public range"]),
    ("API with too many CIDRs", "prod", lambda v: v[key("kubernetes")].__setitem__(
        "apiAccessCidrs", [f"203.0.{i}.0/24" for i in range(41)]), ["41 CIDRs; EKS takes at most 40"]),
    ("pod range inside a VPC", "prod", lambda v: v[key("networks")][3].update(
        cidr="172.20.0.0/16", subnets=[{"zone": "cn-hangzhou-h", "cidr": "172.20.0.0/20"}]),
     ["networks[3].cidr", "overlaps the Alibaba Cloud clusters' pod range"]),
    ("nodes out of the registry's region", "prod", lambda v: (next(
        g for g in v[key("nodeGroups")] if g["name"] == "ali-train").__setitem__("network", "ali-train-sh"),
        v.__setitem__(key("pricing"), {"overrides": [  # priced there, so that the registry's region is what fails
            {"cloud": "alicloud", "instanceType": "ecs.gn7e-c16g1.32xlarge", "region": "cn-shanghai",
             "onDemandHourly": 315.44}]})),
     ["nodeGroups[3].network", "serves VPCs in cn-hangzhou only", "training.prebuiltImages.alicloud"]),
    ("multi-node with a launcher that cannot be elastic", "dev", lambda v: v[key("training")].__setitem__(
        "launcher", "accelerate"), ["training.launcher", "aws-train trains on up to 2 nodes", "elastic torchrun"]),
    ("APPID unquoted or short", "dev", lambda v: v[key("clouds")]["tencentcloud"].__setitem__("appId", "12345"),
     ["clouds.tencentcloud.appId", "10-digit APPID"]),
])
def test_what_the_clouds_refuse_is_refused_here(what: str, stack: str, edit: Any, expected: list[str]) -> None:
    message = _problems(stack, edit)
    for part in expected:
        assert part in message, f"{what}: {part!r} not in\n{message}"


def test_two_resources_with_one_urn_fail_the_plan_naming_both() -> None:
    """The engine refuses duplicate URNs at preview; the offline plan must not pass them."""
    def program() -> None:
        class Thing(pulumi.ComponentResource):
            def __init__(self, name: str, parent: pulumi.Resource | None = None):
                super().__init__("test:index:Thing", name, None, pulumi.ResourceOptions(parent=parent))
        Thing("same")
        Thing("same")

    with pytest.raises(DuplicateUrn, match="test:index:Thing 'same'.*test:index:Thing 'same'"):
        run_program(StackConfig("gpu-training-stack", "dup", {}), INVOKES, COMPUTED, program=program)


def test_every_resource_type_has_been_read_against_its_provider() -> None:
    """infra/data/provider_checks.yaml says, per resource type, what was checked and where."""
    checks = cat.load_provider_checks()
    types = {r.type for stack in ("dev", "prod") for r in shipped(stack)
             if r.custom and not r.type.startswith("pulumi:providers:")}
    missing = sorted(types - set(checks))
    assert not missing, f"not read against its provider yet: {missing}"
    for type_token, entry in checks.items():
        assert entry.get("checked") and entry.get("sources"), type_token


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "infra/data").glob("*.yaml")))
def test_no_data_file_says_one_thing_twice(name: str) -> None:
    """A key given twice in a data file would silently drop the first entry (what a merge of two
    branches that both add a type's provider checks leaves behind): read with the loader that
    refuses duplicates."""
    from infra.core import yamlread

    yamlread.load((ROOT / "infra/data" / name).read_text(encoding="utf-8"))
