"""Multi-node fabrics (#30): EFA, eRDMA and HCC per node group. A copy of prod with a 2-node
p5.48xlarge group, a 2-node Alibaba eRDMA group and a 2-node Tencent HCC group is planned by the
real `make plan` code (JSON), and the tests read its launch template, scaling configuration and
instances; the bad combinations exit 2 naming the group; the node's gts-fabric.sh runs for real
against a laid-out sysfs and a stand-in docker / installer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra import fabric, fabric_plan, userdata
from infra.errors import CatalogError, SpecError
from infra.groups import resolve
from tests.harness import parse_spec
from tests.harness import ROOT, key, project_copy, spec_raw, stack_values, write_stack

GROUPS = key("nodeGroups")
SCRIPT = ROOT / "cloudinit" / "scripts" / "gts-fabric.sh"
FABRIC_GROUPS = [
    {"name": "aws-efa", "cloud": "aws", "network": "aws-train", "instanceType": "p5.48xlarge",
     "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}},
    {"name": "ali-erdma", "cloud": "alicloud", "network": "ali-train", "instanceType": "ecs.ebmgn7ex.32xlarge",
     "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}},
    {"name": "tc-hcc", "cloud": "tencentcloud", "network": "tc-train", "instanceType": "HCCPNV4sne.32XLARGE1280",
     "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}},
]


def fabric_values() -> dict[str, Any]:
    values = stack_values("prod")
    values[GROUPS] += [dict(g) for g in FABRIC_GROUPS]
    values[key("budget")]["monthlyLimitUsd"] = 1_000_000  # three more 8-GPU pairs around the clock
    return values


def plan(tmp: Path, values: dict[str, Any], name: str = "fabric") -> subprocess.CompletedProcess[str]:
    proj = project_copy(tmp)
    (proj / "Pulumi.prod.yaml").write_text((ROOT / "Pulumi.prod.yaml").read_text())  # teams.yaml's base stack
    write_stack(proj, name, values)
    return subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv=['plan','--stack','" + name + "',"
                           "'--format','json']; runpy.run_module('infra.plan', run_name='__main__')"],
                          cwd=proj, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    proc = plan(tmp_path_factory.mktemp("fabric"), fabric_values())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


def resource(plan_json: dict[str, Any], type_token: str, name: str) -> dict[str, Any]:
    found = [r for r in plan_json["resources"] if r["type"] == type_token and r["name"] == name]
    assert len(found) == 1, sorted(r["name"] for r in plan_json["resources"] if r["type"] == type_token)
    return dict(found[0]["inputs"])


def of_type(plan_json: dict[str, Any], type_token: str) -> list[dict[str, Any]]:
    return [r for r in plan_json["resources"] if r["type"] == type_token]


# ---------------------------------------------------------------------------- the catalog

def test_fabric_data_has_the_sources_counts() -> None:
    data = fabric.load()
    assert data[("aws", "p4d.24xlarge")].devices == 4 and data[("aws", "p5.48xlarge")].devices == 32
    assert data[("aws", "p5en.48xlarge")].devices == 16
    assert all(f.source for f in data.values())
    p5 = data[("aws", "p5.48xlarge")].interface_types()
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
    # The same groups on every interface: the training group and (a multi-node group) its
    # rendezvous store's client group (issue 27), nothing at the template's top level.
    assert len(groups) == 1 and next(iter(groups))[0] == "aws-train-training-sg-id", groups
    assert list(next(iter(groups))[1:]) == ["prod-rdzv-aws-efa-clients-id"], groups
    assert not lt.get("vpcSecurityGroupIds")
    assert not lt.get("vpcSecurityGroupIds"), "interfaces carry the groups; the template must not"
    assert not any(n.get("associatePublicIpAddress") for n in nics) and not any(n.get("subnetId") for n in nics)
    asg = resource(planned, "aws:autoscaling/group:Group", "aws-efa-asg")
    assert asg["placementGroup"] and len(asg["vpcZoneIdentifiers"]) == 1, "one zone, one cluster placement group"
    pg = [r for r in of_type(planned, "aws:ec2/placementGroup:PlacementGroup") if r["name"] == "aws-efa-pg"]
    assert pg and pg[0]["inputs"]["strategy"] == "cluster"


def test_prod_p4d_group_gets_efa_by_auto_and_the_network_admits_it(planned: dict[str, Any]) -> None:
    lt = resource(planned, "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    assert [n["interfaceType"] for n in lt["networkInterfaces"]] == ["efa", "efa-only", "efa-only", "efa-only"]
    ingress = resource(planned, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "aws-train-training-self")
    egress = resource(planned, "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
                      "aws-train-training-self-egress")
    for rule in (ingress, egress):
        assert rule["ipProtocol"] == "-1" and rule["referencedSecurityGroupId"] == rule["securityGroupId"]
    # The west network has no fabric group: its security group is unchanged.
    names = [r["name"] for r in of_type(planned, "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")]
    assert "aws-train-west-training-self-egress" not in names


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


# ---------------------------------------------------------------------------- the node

@pytest.fixture(scope="module")
def fabric_stack() -> Any:
    return resolve(parse_spec(spec_raw(fabric_values())))


def test_trainer_env_carries_each_fabrics_nccl_settings(fabric_stack: Any) -> None:
    efa = fabric_stack.group("aws-efa").trainer
    assert (efa["FI_PROVIDER"], efa["FI_EFA_USE_DEVICE_RDMA"], efa["GTS_FABRIC_DEVICES"]) == ("efa", "1", "32")
    erdma = fabric_stack.group("ali-erdma").trainer
    assert erdma["NCCL_IB_HCA"] == "erdma" and erdma["NCCL_IB_GID_INDEX"] == "-1"
    assert erdma["NCCL_IB_ADDR_RANGE"] == "10.40.0.0/16" and erdma["NCCL_NET_GDR_LEVEL"] == "SYS"
    hcc = fabric_stack.group("tc-hcc").trainer
    assert hcc["NCCL_IB_GID_INDEX"] == "3" and hcc["NCCL_IB_HCA"] == "mlx5_bond"
    ctx = userdata.node_context(fabric_stack.spec, fabric_stack.group("aws-efa"), userdata.IMAGE_PLACEHOLDER)
    env = userdata.render_env(ctx)
    assert "FI_PROVIDER=efa" in env and "GTS_FABRIC=efa" in env and "NCCL_SOCKET_IFNAME=en\n" in env
    assert "^lo,docker" not in env, "one NCCL_SOCKET_IFNAME: the fabric's"
    plain = userdata.render_env(userdata.node_context(fabric_stack.spec, fabric_stack.group("ali-train"),
                                                      userdata.IMAGE_PLACEHOLDER))
    assert "NCCL_SOCKET_IFNAME=^lo,docker" in plain and "GTS_FABRIC" not in plain


def lay_out(root: Path, fabric_name: str, names: list[str]) -> Path:
    sysfs = root / "sys"
    for name in names:
        dev = sysfs / "class" / "infiniband" / name / "device"
        if dev.exists():
            continue
        dev.mkdir(parents=True)
        driver = root / "drivers" / ("efa" if fabric_name == "efa" else "other")
        driver.mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(driver)
    return sysfs


def run_fabric(tmp: Path, fabric_name: str, devices: list[str], want: int, nccl_line: str,
               *args: str) -> subprocess.CompletedProcess[str]:
    env_file = tmp / "node.env"
    env_file.write_text(f"GTS_FABRIC={fabric_name}\nGTS_FABRIC_DEVICES={want}\nGTS_IMAGE=trainer@sha256:0\n")
    stubs = tmp / "bin"
    stubs.mkdir(exist_ok=True)
    # Stand-ins for what a real node has: docker (prints NCCL's selection line), the installers.
    (stubs / "docker").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp}/docker.args\necho '{nccl_line}'\n")
    for tool in ("curl", "apt-get", "make", "sysctl", "lsmod", "logger"):
        (stubs / tool).write_text(f"#!/bin/sh\necho \"{tool} $*\" >> {tmp}/calls\n")
    # tar unpacks the EFA installer, git clones GDRCopy: each leaves the script the next step runs.
    recorder = f"#!/bin/sh\necho \"$0 $*\" >> {tmp}/calls\n"
    (stubs / "tar").write_text(recorder + 'while [ $# -gt 1 ]; do [ "$1" = -C ] && d=$2; shift; done\n'
                               'mkdir -p "$d/aws-efa-installer"\n'
                               f'printf "#!/bin/sh\\necho efa_installer.sh \\$* >> {tmp}/calls\\n" '
                               '> "$d/aws-efa-installer/efa_installer.sh"\n'
                               'chmod +x "$d/aws-efa-installer/efa_installer.sh"\n')
    (stubs / "git").write_text(recorder + 'for a; do d=$a; done\nmkdir -p "$d"\n'
                               f'printf "#!/bin/sh\\necho insmod.sh >> {tmp}/calls\\n" > "$d/insmod.sh"\n'
                               'chmod +x "$d/insmod.sh"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "GTS_ENV_FILE": str(env_file),
           "GTS_SYSFS": str(lay_out(tmp, fabric_name, devices)), "GTS_RUN_DIR": str(tmp / "run"),
           "GTS_ETC_DIR": str(tmp / "etc"), "GTS_DEV_DIR": str(tmp / "dev")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_check_passes_devices_and_limits_to_the_container(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "erdma", ["erdma_0", "erdma_1"], 2, "NCCL INFO NET/IB : Using [0]erdma_0:1/RoCE",
                      "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flags = (tmp_path / "run" / "fabric.args").read_text().split()
    assert f"--device={tmp_path}/dev/infiniband" in flags and "--cap-add=IPC_LOCK" in flags
    assert "--ulimit=memlock=-1:-1" in flags
    assert (tmp_path / "run" / "fabric.env").read_text() == "NCCL_IB_HCA=erdma_0,erdma_1\n"
    probe = (tmp_path / "docker.args").read_text()
    assert "NCCL_DEBUG=INFO" in probe and "--cap-add=IPC_LOCK" in probe
    assert not (tmp_path / "run" / "fabric-failed").exists()


@pytest.mark.parametrize("devices, line, why", [
    (["rdmap0", "rdmap1"], "NET/OFI Selected Provider is efa", "efa sees 2 of 4 devices"),
    (["rdmap0", "rdmap1", "rdmap2", "rdmap3"], "NCCL INFO NET/Socket : Using [0]ens5:10.0.0.5<0>",
     "NCCL did not select efa (NET/Socket : Using [0]ens5"),
])
def test_check_keeps_a_node_out_with_one_line(tmp_path: Path, devices: list[str], line: str, why: str) -> None:
    proc = run_fabric(tmp_path, "efa", devices, 4, line, "check")
    assert proc.returncode == 1
    failed = (tmp_path / "run" / "fabric-failed").read_text()
    assert why in failed and failed.count("\n") == 1
    again = run_fabric(tmp_path, "efa", devices + ["rdmap8", "rdmap9"], 4, "NET/OFI Selected Provider is efa",
                       "check")
    assert again.returncode == 1, "a failed node stays out until it reboots"
    unit = (ROOT / "cloudinit" / "units" / "gts-trainer.service").read_text()
    assert "ConditionPathExists=!/run/gpu-training/fabric-failed" in unit
    assert "ExecStartPre=/usr/local/sbin/gts-fabric.sh check" in unit


def test_install_sets_up_efa_user_space_and_host_limits(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "efa", [], 4, "", "install")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "calls").read_text()
    assert "efa-installer.amazonaws.com/aws-efa-installer-latest.tar.gz" in calls
    assert "efa_installer.sh -y" in calls and "NVIDIA/gdrcopy" in calls and "insmod.sh" in calls
    etc = tmp_path / "etc"
    assert "memlock unlimited" in (etc / "security/limits.d/90-gts-fabric.conf").read_text()
    assert "kernel.yama.ptrace_scope = 0" in (etc / "sysctl.d/90-gts-fabric.conf").read_text()
    bootstrap = (ROOT / "cloudinit" / "scripts" / "gts-bootstrap.sh").read_text()
    assert 'step fabric "$SBIN/gts-fabric.sh" install' in bootstrap


def test_no_fabric_means_nothing_to_do(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "", [], 0, "", "check")
    assert proc.returncode == 0 and "no fabric" in proc.stdout
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- Alibaba and Tencent

def test_erdma_group_is_a_scaling_configuration_with_a_high_performance_primary_eni(planned: dict[str, Any]) -> None:
    config = resource(planned, "alicloud:ess/scalingConfiguration:ScalingConfiguration", "ali-erdma-config")
    (nic,) = config["networkInterfaces"]
    assert (nic["instanceType"], nic["networkInterfaceTrafficMode"]) == ("Primary", "HighPerformance")
    # the training group and its rendezvous store's client group (issue 27), as on the other paths
    assert nic["securityGroupIds"] == ["ali-train-training-sg-id", "prod-rdzv-ali-erdma-clients-id"]
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


def test_an_hcc_group_is_fixed_instances_so_a_faulty_node_is_quarantined_not_handed_back(
        fabric_stack: Any) -> None:
    """HCC nodes are CVM instances in an HCC cluster, in no AS group (TencentGpuFleet): a GPU
    fault must not make them ask a scaling group to replace them (GTS_REPLACE=none); the EFA and
    eRDMA groups scale and hand a faulty node back (infra/gpu_health.py replace_mode)."""
    from infra import gpu_health
    from infra.clouds.tencentcloud.fleet import fixed_instances

    hcc = fabric_stack.group("tc-hcc")
    assert fixed_instances(hcc) == hcc.scaling.max and gpu_health.replace_mode(hcc) == "none"
    ctx = userdata.node_context(fabric_stack.spec, hcc, "img")
    assert "GTS_REPLACE=none" in userdata.render_env(ctx).splitlines()
    for name in ("aws-efa", "ali-erdma"):
        assert gpu_health.replace_mode(fabric_stack.group(name)) == "group", name


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


def test_nccl_test_runs_one_process_per_gpu_on_each_host(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "efa", ["rdmap0s1"], 1, "", "nccl-test", "10.0.0.1,node-b.internal")
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "docker.args").read_text().split()
    assert args[-4:] == ["nccl-test", args[-3], "16", "10.0.0.1:8,node-b.internal:8"], args[-6:]


@pytest.mark.parametrize("hosts", ["10.0.0.1;touch /tmp/x", "10.0.0.1 10.0.0.2", "$(id)", "a,,b", "-H x", ""])
def test_nccl_test_refuses_a_host_list_that_is_not_one(hosts: str, tmp_path: Path) -> None:
    """The hosts reach mpirun inside a privileged container: anything but names and addresses,
    comma-separated, is refused before docker runs."""
    proc = run_fabric(tmp_path, "efa", ["rdmap0s1"], 1, "", "nccl-test", hosts)
    assert proc.returncode != 0 and not (tmp_path / "docker.args").exists(), proc.stderr
