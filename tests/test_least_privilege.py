"""Issue 27, on the plan JSON (`python -m infra.plan --format json`, built once per stack): IAM
scope (the cluster-autoscaler, the node roles; parliament, a real process, on every IAM document
of the plan), EFS (access point, file-system policy, TLS mounts), and what a real engine would
refuse or break at the first `up` (explicit providers, placeholders in user data, unroutable API
sources, the Tencent fixed instances' image)."""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.clouds.aws.access import ADDON_REPOSITORIES
from infra.clouds.aws.platform import ecr_repository_arn
from infra.plan.__main__ import build_plan
from infra.plan.engine import unwrap_secrets
from infra.resolve.sharedfs import placeholder
from infra.userdata import IMAGE_PLACEHOLDER
from policies.gts_policy.resources import Res
from policies.gts_policy.rules import evaluate
from tests.harness import ROOT, shipped
from tests.nodes import lay_down, node_env

SHIMS = Path(__file__).parent / "shims"
IDENTITY_POLICIES = {"aws:iam/rolePolicy:RolePolicy": "policy", "aws:iam/policy:Policy": "policy"}


@functools.cache
def plan(stack: str) -> dict[str, Any]:
    return build_plan(stack)


def resources(stack: str, type_token: str) -> list[dict[str, Any]]:
    return [r for r in plan(stack)["resources"] if r["type"] == type_token]


def one(stack: str, type_token: str, name_part: str) -> dict[str, Any]:
    (found,) = [r for r in resources(stack, type_token) if name_part in r["name"]]
    return found


def parliament(docs: dict[str, str], tmp: Path) -> list[dict[str, Any]]:
    """parliament 1.6.4 (`parliament --directory … --json`) on these documents: its findings."""
    folder = tmp / "policies"
    folder.mkdir()
    for name, doc in docs.items():
        (folder / f"{name}.json").write_text(doc)
    env = {**os.environ, "PYTHONPATH": str(SHIMS)}  # pkg_resources for setuptools >= 81 (tests/shims)
    run = subprocess.run([sys.executable, "-m", "parliament.cli", "--directory", str(folder), "--json"],
                         capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert run.returncode in (0, 1), run.stderr
    return [json.loads(line) for line in run.stdout.splitlines() if line.strip()]


# ------------------------------------------------------------------------------- IAM scope

def test_autoscaler_writes_only_to_its_own_clusters_tagged_groups() -> None:
    """kubernetes/autoscaler cluster-autoscaler/cloudprovider/aws/README.md, "Minimal IAM
    Permissions Policy": SetDesiredCapacity / TerminateInstanceInAutoScalingGroup under
    aws:ResourceTag/k8s.io/cluster-autoscaler/enabled = true and …/<cluster> = owned; here also on
    the cluster's own GPU groups' ARNs only."""
    clusters = {c["inputs"]["name"] for c in resources("prod", "aws:eks/cluster:Cluster")}
    policies = [r for r in resources("prod", "aws:iam/rolePolicy:RolePolicy") if r["name"].endswith("-ca-policy")]
    assert clusters and len(policies) == len(clusters)
    node_groups = resources("prod", "aws:eks/nodeGroup:NodeGroup")
    for pol in policies:
        doc = json.loads(pol["inputs"]["policy"])
        (cluster,) = [c for c in clusters if pol["name"].startswith(c)]
        writes = [s for s in doc["Statement"] if "autoscaling:SetDesiredCapacity" in s["Action"]]
        assert len(writes) == 1
        (write,) = writes
        assert set(write["Action"]) == {"autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"}
        assert write["Condition"]["StringEquals"] == {"aws:ResourceTag/k8s.io/cluster-autoscaler/enabled": "true",
                                                      f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cluster}": "owned"}
        gpu_groups = [n["name"] for n in node_groups
                      if n["inputs"]["clusterName"] == cluster and n["inputs"]["amiType"].endswith("NVIDIA")]
        assert gpu_groups
        # the mock engine names a node group's Auto Scaling group eks-<node group>-asg
        assert sorted(write["Resource"]) == sorted(
            f"arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:*:autoScalingGroupName/eks-{g}-asg"
            for g in gpu_groups)
        for s in doc["Statement"]:
            if s["Resource"] == "*":
                assert all(a.split(":")[1].startswith(("Describe", "GetInstanceTypes")) for a in s["Action"]), s


def test_parliament_finds_nothing_in_the_plans_iam_documents(tmp_path: Path) -> None:
    """Every identity policy of both shipped plans through parliament: no finding at all (it
    reports RESOURCE_STAR for a write that could name its resource, e.g. the autoscaler's old
    "Resource": "*"). The autoscaler's policy with its writes widened back to "*" is the
    control: parliament must flag exactly that."""
    docs = {f"{stack}-{r['name']}": r["inputs"][field]
            for stack in ("dev", "prod") for r in plan(stack)["resources"]
            for t, field in IDENTITY_POLICIES.items() if r["type"] == t}
    assert len(docs) >= 10 and not any(d == "[secret]" for d in docs.values())
    ca = json.loads(next(d for n, d in docs.items() if n.endswith("-ca-policy")))
    for s in ca["Statement"]:
        if "autoscaling:SetDesiredCapacity" in s["Action"]:
            s["Resource"] = "*"
    docs["control-autoscaler-wildcard"] = json.dumps(ca)
    findings = parliament(docs, tmp_path)
    flagged = {(Path(f["location"]["filepath"]).stem, f["issue"]) for f in findings}
    assert flagged == {("control-autoscaler-wildcard", "RESOURCE_STAR")}, findings
    (control,) = findings
    assert set(control["detail"]) == {"autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"}


def test_node_roles_use_no_broad_managed_policy_and_pull_only_their_stacks_image() -> None:
    """AmazonSSMManagedInstanceCore (every SSM parameter) and AmazonEC2ContainerRegistryReadOnly
    (every repository) are gone; what EKS itself requires of its roles stays."""
    for stack in ("dev", "prod"):
        attached = {r["inputs"]["policyArn"].rsplit("/", 1)[1] for r in resources(stack, "aws:iam/rolePolicyAttachment:RolePolicyAttachment")}
        assert attached <= {"AmazonEKSClusterPolicy", "AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy"}, attached
        (repo,) = resources(stack, "aws:ecr/repository:Repository")
        own = f"arn:aws:ecr:us-east-1:123456789012:repository/{repo['inputs']['name']}"
        profiles = resources(stack, "aws:iam/instanceProfile:InstanceProfile")
        pulls = [r for r in resources(stack, "aws:iam/rolePolicy:RolePolicy") if r["name"].endswith("-pull")]
        assert profiles and len(pulls) == len(profiles) + (1 if resources(stack, "aws:eks/cluster:Cluster") else 0)
        for pol in pulls:
            statements = {s["Sid"]: s for s in json.loads(pol["inputs"]["policy"])["Statement"]}
            # GetAuthorizationToken takes no resource (Service Authorization Reference for ECR)
            assert statements["RegistryToken"] == {"Sid": "RegistryToken", "Effect": "Allow",
                                                   "Action": "ecr:GetAuthorizationToken", "Resource": "*"}
            addons = [f"arn:aws:ecr:*:*:repository/{r}" for r in ADDON_REPOSITORIES] if "eks-node" in pol["name"] else []
            assert statements["PullOwnImages"]["Resource"] == [own, *addons]
            assert not any(a.startswith("ssm:GetParameter") for s in statements.values() for a in s["Action"])


@pytest.mark.parametrize("ref, arn", [
    ("111122223333.dkr.ecr.eu-west-1.amazonaws.com/team/trainer@sha256:" + "a" * 64,
     "arn:aws:ecr:eu-west-1:111122223333:repository/team/trainer"),
    ("111122223333.dkr.ecr.cn-north-1.amazonaws.com.cn/trainer:v1", "arn:aws-cn:ecr:cn-north-1:111122223333:repository/trainer"),
    ("nvcr.io/nvidia/pytorch:25.01-py3", None),
    ("111122223333.dkr.ecr.eu-west-1.amazonaws.com.evil.example/x:1", None),
])
def test_a_prebuilt_image_is_pulled_from_its_own_repository_only(ref: str, arn: str | None) -> None:
    assert ecr_repository_arn(ref) == arn


# ------------------------------------------------------------------------------------- EFS

def test_efs_has_an_access_point_and_a_policy_requiring_tls_and_the_groups_roles() -> None:
    """EFS user guide (efs-access-points; iam-access-control-nfs-efs): POSIX user and root
    directory on the access point; Deny on aws:SecureTransport=false; ClientMount/ClientWrite
    only for the mounting groups' node roles, through that access point."""
    (fs,) = resources("prod", "aws:efs/fileSystem:FileSystem")
    (ap,) = resources("prod", "aws:efs/accessPoint:AccessPoint")
    assert ap["inputs"]["posixUser"] == {"uid": 1000, "gid": 1000}
    assert ap["inputs"]["rootDirectory"]["path"] == "/training"
    assert ap["inputs"]["rootDirectory"]["creationInfo"] == {"ownerUid": 1000, "ownerGid": 1000, "permissions": "0750"}
    (fsp,) = resources("prod", "aws:efs/fileSystemPolicy:FileSystemPolicy")
    doc = json.loads(fsp["inputs"]["policy"])
    deny, allow = doc["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert set(allow["Action"]) == {"elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"}
    assert allow["Condition"]["StringEquals"]["elasticfilesystem:AccessPointArn"].endswith(
        "access-point/" + _mock_id(ap["name"], "fsap"))
    roles = {r["name"]: r for r in resources("prod", "aws:iam/role:Role")}
    # prod's aws-train network: the VM group aws-train mounts it, and the EKS group (node role)
    expected = sorted(f"arn:aws:iam::123456789012:role/{roles[n]['inputs'].get('name') or n}"
                      for n in ("prod-aws-access-aws-train", "prod-aws-access-eks-node"))
    assert allow["Principal"]["AWS"] == expected
    assert fs["inputs"]["encrypted"] is True


def _mock_id(name: str, prefix: str) -> str:
    import hashlib

    return f"{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:17]}"


def test_vm_nodes_mount_efs_with_tls_through_the_access_point(tmp_path: Path) -> None:
    """The VM group's real user data, decoded as its node decodes it: mount.efs with tls, iam
    and the access point's id, at the file system's address."""
    (lt,) = [r for r in shipped("prod") if r.type == "aws:ec2/launchTemplate:LaunchTemplate" and r.name == "aws-train-lt"]
    lay_down(base64.b64decode(unwrap_secrets(lt.inputs)["userData"]), tmp_path)
    env = node_env(tmp_path)
    (ap,) = resources("prod", "aws:efs/accessPoint:AccessPoint")
    assert env["GTS_SHARED_FS"] == "efs"
    assert env["GTS_SHARED_OPTIONS"].split(",") == ["tls", "iam", "_netdev", f"accesspoint={_mock_id(ap['name'], 'fsap')}"]
    (fs,) = resources("prod", "aws:efs/fileSystem:FileSystem")
    assert env["GTS_SHARED_SOURCE"] == f"{_mock_id(fs['name'], 'fs')}.efs.mock-region.amazonaws.com:/"


def test_jobs_mount_efs_through_the_csi_driver_with_tls() -> None:
    """kubernetes-sigs/aws-efs-csi-driver examples/kubernetes/access_points: volumeHandle
    `<fs>::<fsap>`; access point mounts require TLS."""
    pvs = [r for r in resources("prod", "kubernetes:core/v1:PersistentVolume") if r["name"].endswith("-shared-pv")]
    (fs,) = resources("prod", "aws:efs/fileSystem:FileSystem")
    (ap,) = resources("prod", "aws:efs/accessPoint:AccessPoint")
    efs = [pv for pv in pvs if "csi" in pv["inputs"]["spec"]]
    assert efs, [pv["name"] for pv in pvs]
    for pv in efs:
        spec = pv["inputs"]["spec"]
        assert spec["csi"]["driver"] == "efs.csi.aws.com"
        assert spec["csi"]["volumeHandle"] == f"{_mock_id(fs['name'], 'fs')}::{_mock_id(ap['name'], 'fsap')}"
        assert "tls" in spec["mountOptions"] and "nfs" not in spec
    addons = {a["inputs"]["addonName"] for a in resources("prod", "aws:eks/addon:Addon")}
    assert "aws-efs-csi-driver" in addons


# ----------------------------------------------------------------------- deploy blockers

@pytest.mark.parametrize("stack", ["dev", "prod", "team-vision"])
def test_every_custom_resource_has_an_explicit_provider_when_defaults_are_disabled(stack: str) -> None:
    """pulumi/pulumi#8829: with `pulumi:disable-default-providers`, a resource without an
    explicit provider fails at `up`. The plan records the provider reference the engine gets."""
    config = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())["config"]
    disabled = config.get("pulumi:disable-default-providers") or []
    assert disabled, f"{stack} no longer disables default providers: this test would prove nothing"
    custom = [r for r in shipped(stack) if r.custom and not r.type.startswith("pulumi:providers:")]
    missing = [r.urn for r in custom if (r.type.split(":", 1)[0] in disabled or "*" in disabled)
               and (not r.provider or "::default" in r.provider)]
    assert not missing, missing
    assert any(r.type == "docker-build:index:Image" for r in custom) or stack == "team-vision"


def _user_data_fields(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [v for k, v in value.items() if k == "userData" and isinstance(v, str)] + [
            f for v in value.values() for f in _user_data_fields(v)]
    if isinstance(value, list):
        return [f for v in value for f in _user_data_fields(v)]
    return []


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_no_placeholder_reaches_any_user_data(stack: str, tmp_path: Path) -> None:
    """Every user data field of the plan, decoded as its node decodes it (cloud-init's
    write_files, EKS's MIME part, the node pool script): none carries the image placeholder or
    a placeholder file-system address or access point."""
    from tests.harness import parse_spec as parse
    from tests.harness import spec_raw, stack_values

    spec = parse(spec_raw(stack_values(stack)))
    fakes = {IMAGE_PLACEHOLDER, "fsap-0123456789abcdef0"} | {
        placeholder(n.shared_fs).source for n in spec.networks if n.shared_fs is not None}
    checked = 0
    for r in shipped(stack):
        for i, field in enumerate(_user_data_fields(unwrap_secrets(r.inputs))):
            root = tmp_path / f"{r.name}-{i}"
            raw = base64.b64decode(field)
            if raw.startswith(b"Content-Type: multipart"):
                assert all(f.encode() not in raw for f in fakes)
            lay_down(raw, root)
            texts = [p.read_bytes() for p in root.rglob("*") if p.is_file()]
            found = [f for f in fakes for t in texts if f.encode() in t]
            assert not found, (r.urn, found)
            checked += 1
    assert checked >= 5


def test_unroutable_api_sources_are_refused_by_a_real_preview_and_advised_offline() -> None:
    """RFC 5737 / RFC 3849 documentation ranges and private-use ranges in
    kubernetes.apiAccessCidrs: the pack's rule is mandatory (a real preview, whatever the
    stack's pack config), the offline plan shows it as advisory so the example stack plans."""
    offline = [v for v in plan("prod")["violations"] if v["policy"] == "kubernetes-api-sources-routable"]
    assert offline and all(v["enforcement"] == "advisory" for v in offline)
    flagged = {v["resource"] for v in offline}
    assert any("eks" in n for n in flagged) and any("registry" in n for n in flagged)
    views = [Res(r.type, r.name, unwrap_secrets(r.inputs), False) for r in shipped("prod")]
    real = [v for v in evaluate(views, {}) if v["policy"] == "kubernetes-api-sources-routable"]
    assert real and all(v["enforcement"] == "mandatory" for v in real)
    for cidr, refused in [("203.0.113.0/24", True), ("2001:db8::/48", True), ("192.168.1.0/24", True),
                          ("100.64.0.0/16", True), ("8.8.8.0/24", False), ("2606:4700::/32", False)]:
        eks = Res("aws:eks/cluster:Cluster", "c", {"vpcConfig": {"publicAccessCidrs": [cidr]}}, False)
        assert bool(evaluate([eks], {}) and [v for v in evaluate([eks], {})
                                              if v["policy"] == "kubernetes-api-sources-routable"]) is refused, cidr


def test_tencent_fixed_instances_keep_their_image_on_a_routine_up() -> None:
    """A newer image from the lookup reinstalls a tencentcloud Instance in place (terraform-
    provider-tencentcloud resource_tc_instance Update: ResetInstance); fixed instances ignore it."""
    # (the rendezvous stores' images are pinned with the stores, infra/clouds/*/rendezvous.py)
    fixed = [r for r in shipped("prod") if r.type == "tencentcloud:Instance/instance:Instance" and "GpuFleet" in r.urn]
    assert fixed
    for r in fixed:
        assert "imageId" in r.options["ignoreChanges"], r.urn
