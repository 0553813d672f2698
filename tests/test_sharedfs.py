"""Shared file systems (networks[].sharedFs): what each cloud's plan creates (encrypted where the
cloud can, reachable only from the stack's CIDRs), what the plan charges for it, and the seams
plan -> node: the address the plan hands a VM node is what the node's gts-shared.sh mounts and
what its trainer container sees; a Job gets the same file system through a PersistentVolume."""

from __future__ import annotations

import base64
import os
import shlex
import stat
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.core.errors import SpecError
from infra.plan.engine import Registered
from infra.plan.invokes import COMPUTED
from tests.harness import parse_spec
from tests.harness import ROOT, by_type, policy_hits, run_stack, spec_raw, stack_values
from tests.nodes import lay_down, node_env
from tests.contract_helpers import VM_NODES, container_env, job_containers, node_env_of
from tests.fabric_helpers import node_lib

NETS, GROUPS = "gpu-training-stack:networks", "gpu-training-stack:nodeGroups"
TYPES = {"aws-train": "efs", "ali-train": "nas", "tc-train": "cfs"}


def with_shared(types: dict[str, str], size_gb: int = 500) -> Any:
    def edit(values: dict[str, Any]) -> None:
        for net in values[NETS]:
            if net["name"] in types:
                net["sharedFs"] = {"type": types[net["name"]], "sizeGb": size_gb}
        for group in values[GROUPS]:
            group["sharedFs"] = group["network"] in types
    return edit


@pytest.fixture(scope="module")
def dev_shared(tmp_path_factory: pytest.TempPathFactory) -> list[Registered]:
    return run_stack("dev", with_shared(TYPES), tmp_path_factory.mktemp("shared"))


def one(resources: list[Registered], type_token: str, name: str | None = None) -> Registered:
    found = [r for r in by_type(resources, type_token) if name is None or r.name == name]
    assert len(found) == 1, [r.name for r in by_type(resources, type_token)]
    return found[0]


# ------------------------------------------------------------------ what each cloud creates

def test_efs_is_encrypted_with_the_stack_key_and_open_to_the_stack_only(dev_shared: list[Registered]) -> None:
    efs = one(dev_shared, "aws:efs/fileSystem:FileSystem")
    key = one(dev_shared, "aws:kms/key:Key")
    assert efs.inputs["encrypted"] is True and efs.inputs["throughputMode"] == "elastic"
    assert efs.inputs["kmsKeyId"] == f"{key.name}-arn" or efs.inputs["kmsKeyId"].startswith("arn:")
    targets = by_type(dev_shared, "aws:efs/mountTarget:MountTarget")
    aws_net = next(n for n in stack_values("dev")[NETS] if n["name"] == "aws-train")
    assert len(targets) == len({s["zone"] for s in aws_net["subnets"]}), "one mount target per zone"
    rules = [r for r in by_type(dev_shared, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
             if "shared" in r.name]
    assert {(r.inputs["fromPort"], r.inputs["toPort"], r.inputs["cidrIpv4"]) for r in rules} == \
        {(2049, 2049, aws_net["cidr"])}


def test_nas_and_cfs_admit_the_stack_cidrs_only_and_nas_is_encrypted(dev_shared: list[Registered]) -> None:
    cidrs = {n["name"]: n["cidr"] for n in stack_values("dev")[NETS]}
    nas = one(dev_shared, "alicloud:nas/fileSystem:FileSystem")
    assert nas.inputs["encryptType"] == 1 and nas.inputs["protocolType"] == "NFS"
    target = one(dev_shared, "alicloud:nas/mountTarget:MountTarget")
    group = one(dev_shared, "alicloud:nas/accessGroup:AccessGroup")
    assert target.inputs["accessGroupName"] == group.inputs["accessGroupName"] != "DEFAULT_VPC_GROUP_NAME"
    assert [r.inputs["sourceCidrIp"] for r in by_type(dev_shared, "alicloud:nas/accessRule:AccessRule")] == \
        [cidrs["ali-train"]]
    cfs_rules = by_type(dev_shared, "tencentcloud:Cfs/accessRule:AccessRule")
    assert [(r.inputs["authClientIp"], r.inputs["rwPermission"]) for r in cfs_rules] == [(cidrs["tc-train"], "RW")]
    cfs = one(dev_shared, "tencentcloud:Cfs/fileSystem:FileSystem")
    assert cfs.inputs["accessGroupId"] == f"{one(dev_shared, 'tencentcloud:Cfs/accessGroup:AccessGroup').name}-id"


def test_the_policy_pack_holds_shared_file_systems_to_encryption(dev_shared: list[Registered]) -> None:
    assert policy_hits(dev_shared, "disks-encrypted") == []
    assert [h for h in policy_hits(dev_shared, "known-sdk-gaps") if "tc-train-cfs" in h]
    unset: dict[str, dict[str, Any]] = {"alicloud:nas/fileSystem:FileSystem": {"encryptType": 0},
                                        "aws:efs/fileSystem:FileSystem": {"encrypted": False}}
    bare = [replace(r, inputs={**r.inputs, **unset.get(r.type, {})}) for r in dev_shared]
    hits = policy_hits(bare, "disks-encrypted")
    assert any("ali-train-nas" in h for h in hits) and any("aws-train-efs" in h for h in hits)


def test_the_plan_prices_each_shared_file_system() -> None:
    """500 GB at the prices in storage_prices.yaml, read here independently of infra/resolve/sharedfs.py."""
    from infra.resolve.cost import stack_cost
    from infra.resolve.groups import resolve

    values = stack_values("dev")
    with_shared(TYPES)(values)
    spec = parse_spec(spec_raw(values))
    prices = yaml.safe_load((ROOT / "infra/data/storage_prices.yaml").read_text())
    by_cloud = stack_cost(resolve(spec))["by_cloud"]
    assert by_cloud["aws"]["shared_fs_monthly_usd"] == pytest.approx(500 * prices["aws"]["sharedFs"]["efs"], abs=0.01)
    rate = spec.pricing.cny_per_usd
    assert by_cloud["alicloud"]["shared_fs_monthly_usd"] == pytest.approx(
        500 * prices["alicloud"]["sharedFs"]["nas"] / rate, abs=0.01)
    assert by_cloud["tencentcloud"]["shared_fs_monthly_usd"] == pytest.approx(
        500 * prices["tencentcloud"]["sharedFs"]["cfs"] / rate, abs=0.01)
    without = stack_cost(resolve(parse_spec(spec_raw(stack_values("dev")))))["by_cloud"]["aws"]
    assert by_cloud["aws"]["monthly_usd"] == pytest.approx(without["monthly_usd"] + 150.0, abs=0.02)


# ------------------------------------------------------------------ the seam plan -> VM node

STUBS = {
    "mount": 'echo "mount $*" >> "$GTS_SANDBOX/calls"; [ ! -e "$GTS_SANDBOX/unreachable" ]',
    "getent": "exit 0",
    "mountpoint": "exit 1",
    "chown": 'echo "chown $*" >> "$GTS_SANDBOX/calls"',
    "chmod": "exit 0",
    "stat": "echo 0",
    "apt-get": 'echo "apt-get $*" >> "$GTS_SANDBOX/calls"; case "$*" in *install*) '
               'printf "#!/bin/sh\\n" > "$GTS_SANDBOX/bin/mount.nfs"; chmod +x "$GTS_SANDBOX/bin/mount.nfs";; esac',
    "logger": "exit 0",
    "sleep": "exit 0",
}


def sandbox(tmp: Path, env_text: str) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp / "node.env").write_text(env_text)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "GTS_SANDBOX": str(tmp), "GTS_ENV_FILE": str(tmp / "node.env"),
            "GTS_SHARED_ATTEMPTS": "3", "GTS_LIB_DIR": str(node_lib(tmp))}


def env_file(env: dict[str, str], shared_dir: Path) -> str:
    return "".join(f"{k}={shared_dir if k == 'GTS_SHARED_DIR' else v}\n" for k, v in env.items())


@pytest.mark.parametrize("cloud", sorted(VM_NODES))
def test_a_vm_node_mounts_what_the_plan_created(dev_shared: list[Registered], cloud: str, tmp_path: Path) -> None:
    env = node_env_of(dev_shared, cloud, tmp_path)
    shared_dir = tmp_path / "shared"
    box = sandbox(tmp_path / "box", env_file(env, shared_dir))
    proc = subprocess.run(["bash", str(ROOT / "cloudinit/scripts/gts-shared.sh")], env=box, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "box/calls").read_text().splitlines()
    mounts = [c for c in calls if c.startswith("mount ")]
    assert mounts == [f"mount -t {env['GTS_SHARED_FS']} -o {env['GTS_SHARED_OPTIONS']} {env['GTS_SHARED_SOURCE']} "
                      f"{shared_dir}"]
    created = {"aws": ("aws:efs/fileSystem:FileSystem", "dnsName"),
               "alicloud": ("alicloud:nas/mountTarget:MountTarget", "mountTargetDomain"),
               "tencentcloud": ("tencentcloud:Cfs/fileSystem:FileSystem", "mountIp")}[cloud]
    made = one(dev_shared, created[0])
    address = COMPUTED[made.type](made.name, made.inputs)[created[1]]  # what the engine reported it created
    assert env["GTS_SHARED_SOURCE"].startswith(f"{address}:/")
    # EFS through AWS's mount helper (TLS, the access point; infra/resolve/sharedfs.py), the NFS types through nfs-common
    client = "amazon-efs-utils" if cloud == "aws" else "nfs-common"
    assert any(c.startswith("apt-get") and c.endswith(f"install -y -q {client}") for c in calls)
    assert f"chown 1000:1000 {shared_dir}" in calls
    assert env["SHARED_DIR"] == "/shared"


def test_a_file_system_that_never_answers_fails_the_unit(dev_shared: list[Registered], tmp_path: Path) -> None:
    env = node_env_of(dev_shared, "aws", tmp_path)
    box = sandbox(tmp_path / "box", env_file(env, tmp_path / "shared"))
    (tmp_path / "box/unreachable").touch()
    proc = subprocess.run(["bash", str(ROOT / "cloudinit/scripts/gts-shared.sh")], env=box, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "could not mount" in proc.stdout
    unit = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    assert "Requires=docker.service gts-dataset.service gts-shared.service" in unit


def _trainer_command(env: dict[str, str], tmp: Path) -> list[str]:
    """gts-trainer.service's ExecStart as systemd then sh run it ($$ is systemd's escaped $), with a
    docker that prints its arguments."""
    unit = (ROOT / "cloudinit/units/gts-trainer.service").read_text().replace("\\\n", " ")
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart=").replace("$$", "$"))
    assert words[:2] == ["/bin/sh", "-c"]
    fake = tmp / "docker"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    current = tmp / "gts-image"  # gts-image.py with nothing published: the user data's image
    current.write_text('#!/bin/sh\necho "$GTS_IMAGE"\n')
    current.chmod(0o755)
    script = words[2].replace("/usr/bin/docker", str(fake)).replace("/usr/bin/python3 /usr/local/sbin/gts-image.py",
                                                                     str(current))
    out = subprocess.run(["sh", "-c", script], env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.splitlines()


def test_the_trainer_container_sees_the_shared_directory_only_where_mounted(dev_shared: list[Registered],
                                                                             tmp_path: Path) -> None:
    env = node_env_of(dev_shared, "aws", tmp_path)
    args = _trainer_command(env, tmp_path)
    assert "/shared:/shared" in args and args[args.index("/shared:/shared") - 1] == "-v"
    plain = _trainer_command({**env, "GTS_SHARED_DIR": ""}, tmp_path)
    assert not [a for a in plain if "shared" in a]
    assert plain[-1] == args[-1] == env["GTS_IMAGE"]


# ------------------------------------------------------------------ Kubernetes

def test_a_job_mounts_the_network_file_system_through_a_bound_claim(tmp_path: Path) -> None:
    def edit(values: dict[str, Any]) -> None:
        with_shared({"aws-train": "efs"})(values)
    resources = run_stack("prod", edit, tmp_path)
    efs = one(resources, "aws:efs/fileSystem:FileSystem")
    pv = one(resources, "kubernetes:core/v1:PersistentVolume")
    pvc = one(resources, "kubernetes:core/v1:PersistentVolumeClaim")
    access_point = one(resources, "aws:efs/accessPoint:AccessPoint")
    # EFS through its CSI driver: the file system and its access point, with TLS (issue 27)
    assert pv.inputs["spec"]["csi"]["volumeHandle"] == (f"{COMPUTED[efs.type](efs.name, efs.inputs)['id']}::"
                                                        f"{COMPUTED[access_point.type](access_point.name, {})['id']}")
    assert pv.inputs["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert "_netdev" not in pv.inputs["spec"]["mountOptions"] and "tls" in pv.inputs["spec"]["mountOptions"]
    assert pvc.inputs["spec"]["volumeName"] == pv.inputs["metadata"]["name"]
    job = next(r for r in resources if r.name == "aws-eks-train-job")
    pod = job.inputs["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if v["name"] == "shared")
    assert claim["persistentVolumeClaim"]["claimName"] == pvc.inputs["metadata"]["name"]
    trainer = job_containers(job)["trainer"]
    assert {"name": "shared", "mountPath": "/shared"} in trainer["volumeMounts"]
    assert container_env(trainer)["SHARED_DIR"] == "/shared"
    assert not any(v["name"] == "shared" for v in
                   next(r for r in resources if r.name == "aws-eks-infer-job").inputs["spec"]["template"]["spec"]
                   ["volumes"]) if any(r.name == "aws-eks-infer-job" for r in resources) else True


# ------------------------------------------------------------------ what a spec may ask

@pytest.mark.parametrize("edit, named", [
    (lambda v: with_shared({"aws-train": "nas"})(v), "networks[0].sharedFs.type: 'nas' is not offered on AWS"),
    (lambda v: v[GROUPS][0].update(sharedFs=True), "nodeGroups[0].sharedFs: network aws-train has no sharedFs"),
    (lambda v: with_shared({"aws-train": "fsx-lustre"}, size_gb=1500)(v), "FSx for Lustre takes 1200, 2400"),
    (lambda v: (with_shared({"aws-train": "efs"})(v), v[NETS][0]["sharedFs"].update(mountPath="/scratch/x")),
     "would hide a system, image, node or scratch directory"),
    (lambda v: (with_shared({"aws-train": "efs"})(v), v[NETS][0]["sharedFs"].update(mountPath="/opt/gts")),
     "would hide a system, image, node or scratch directory"),
    (lambda v: (with_shared({"aws-train": "efs"})(v), v[NETS][0]["sharedFs"].update(mountPath="/shared/../etc")),
     "is not a plain absolute path"),
    (lambda v: (with_shared({"aws-train": "efs"})(v), v[NETS][0]["sharedFs"].update(mountPath="//etc")),
     "is not a plain absolute path"),
])
def test_a_shared_file_system_the_cloud_cannot_give_is_refused(edit: Any, named: str) -> None:
    values = stack_values("dev")
    edit(values)
    with pytest.raises(SpecError) as err:
        parse_spec(spec_raw(values))
    assert named in str(err.value)


def test_lustre_is_refused_for_kubernetes_groups() -> None:
    values = stack_values("prod")
    with_shared({"aws-train": "fsx-lustre"}, size_gb=1200)(values)
    with pytest.raises(SpecError) as err:
        parse_spec(spec_raw(values))
    assert "mounts on VM groups only here" in str(err.value) and "nodeGroups[1].sharedFs" in str(err.value)


def test_make_userdata_shows_a_placeholder_address(tmp_path: Path) -> None:
    from infra import userdata
    from infra.resolve.groups import resolve

    values = stack_values("dev")
    with_shared(TYPES)(values)
    stack = resolve(parse_spec(spec_raw(values)))
    text = userdata.for_group(stack.spec, stack.group("aws-train"))
    root = tmp_path / "node"
    lay_down(base64.b64decode(text) if not text.startswith("#") else text.encode(), root)
    assert node_env(root)["GTS_SHARED_SOURCE"].endswith("-example.amazonaws.com:/")
    assert os.path.exists(root / "etc/gpu-training/node.env")


def test_lustre_takes_what_fsx_accepts_and_a_key_of_its_own_region(tmp_path: Path) -> None:
    """aws.fsx.LustreFileSystem (pulumi_aws fsx/lustre_file_system.py; provider_checks.yaml):
    one subnet given as a string, PERSISTENT_2 (the default is SCRATCH_1), a throughput tier it
    lists, Lustre ports from the stack and among the servers; the stack's KMS key is regional, so a
    network in another region gets none (FSx then uses its AWS-managed key)."""
    def edit(values: dict[str, Any]) -> None:
        for net in values[NETS]:
            if net["name"] == "aws-train-west":
                net["sharedFs"] = {"type": "fsx-lustre", "sizeGb": 2400, "throughputPerTib": 250}
    resources = run_stack("prod", edit, tmp_path)
    lustre = one(resources, "aws:fsx/lustreFileSystem:LustreFileSystem")
    inputs = lustre.inputs
    assert isinstance(inputs["subnetIds"], str) and inputs["deploymentType"] == "PERSISTENT_2"
    assert inputs["storageCapacity"] == 2400 and inputs["perUnitStorageThroughput"] == 250
    assert inputs["fileSystemTypeVersion"] == "2.15" and "kmsKeyId" not in inputs
    west = next(n for n in stack_values("prod")[NETS] if n["name"] == "aws-train-west")
    assert west.get("region") not in (None, stack_values("prod")["gpu-training-stack:clouds"]["aws"]["region"])
    rules = [r.inputs for r in by_type(resources, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
             if r.name.startswith("aws-train-west-shared")]
    ports = {(r["fromPort"], r["toPort"]) for r in rules}
    assert ports == {(988, 988), (1018, 1023)}
    assert {r["cidrIpv4"] for r in rules if "cidrIpv4" in r} >= {west["cidr"]}
    assert [r for r in rules if "referencedSecurityGroupId" in r], "the servers reach each other"
    efs = one(resources, "aws:efs/fileSystem:FileSystem")  # prod's EFS is in the key's region
    assert efs.inputs["kmsKeyId"]


def test_a_nas_permission_group_name_is_unique_per_stack(dev_shared: list[Registered]) -> None:
    """The group's name is its identity in the region (nas/access_group.py): two stacks with a
    network of the same name must not collide."""
    name = one(dev_shared, "alicloud:nas/accessGroup:AccessGroup").inputs["accessGroupName"]
    assert name.startswith("gts-dev-") and name.endswith("-ali-train") and name != "ali-train-shared"
