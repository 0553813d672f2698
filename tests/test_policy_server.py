"""The policy pack as the Pulumi CLI runs it: a copy of `policies/` alone in a folder of its
own (what `pulumi policy publish` ships), its requirements satisfied from its own
requirements.txt, started with `python -m pulumi.policy <engine> <folder>` from that folder and
nothing of the project on the path; this test speaks the engine's gRPC protocol to it
(GetAnalyzerInfo, Configure, Analyze, Remediate, AnalyzeStack)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

from policies.gts_policy.rules import RULES, configured

ROOT = Path(__file__).resolve().parents[1]
LEVELS = {"advisory": analyzer_pb2.ADVISORY, "mandatory": analyzer_pb2.MANDATORY, "disabled": analyzer_pb2.DISABLED,
          "remediate": analyzer_pb2.REMEDIATE}


def _copy_of_the_pack(tmp: Path) -> Path:
    pack = tmp / "gpu-training-stack-pack"
    shutil.copytree(ROOT / "policies", pack, ignore=shutil.ignore_patterns("__pycache__", "venv"))
    # Its requirements, from its own file, into the project's virtualenv (all present already:
    # --no-index proves nothing else is needed).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "-r", str(pack / "requirements.txt")],
                   check=True, timeout=300, capture_output=True)
    return pack


@pytest.fixture(scope="module")
def analyzer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[analyzer_pb2_grpc.AnalyzerStub]:
    pack = _copy_of_the_pack(tmp_path_factory.mktemp("published"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, "-m", "pulumi.policy", "127.0.0.1:1", str(pack)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=pack, env=env)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().strip())  # the engine reads the port from the first line
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        yield analyzer_pb2_grpc.AnalyzerStub(channel)
        channel.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _struct(value: dict[str, object]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(value)
    return s


def _configure(stub: analyzer_pb2_grpc.AnalyzerStub, path: Path) -> None:
    config: dict[str, analyzer_pb2.PolicyConfig] = {}
    for rule in RULES:  # the engine's Configure, from the file as the pack's own reader sees it
        level, settings = configured(rule, json.loads(path.read_text()))
        config[rule.name] = analyzer_pb2.PolicyConfig(enforcementLevel=LEVELS[level], properties=_struct(settings))
    stub.Configure(analyzer_pb2.ConfigureAnalyzerRequest(policyConfig=config))


def test_the_pack_serves_every_rule(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty())
    assert info.name == "gpu-training-stack"
    assert {p.name for p in info.policies} == {r.name for r in RULES}


def test_dev_config_makes_on_demand_gpu_capacity_a_mandatory_violation(
        analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    _configure(analyzer, ROOT / "policies" / "dev.json")
    tags = {"owner": "o", "cost-center": "c", "env": "dev"}

    def asg(on_demand: bool) -> analyzer_pb2.AnalyzerResource:
        props = {"maxSize": 2, "minSize": 1, "tags": [{"key": k, "value": v} for k, v in tags.items()],
                 "mixedInstancesPolicy": {"instancesDistribution": {
                     "onDemandBaseCapacity": 1 if on_demand else 0,
                     "onDemandPercentageAboveBaseCapacity": 100 if on_demand else 0},
                     "launchTemplate": {"overrides": [{"instanceType": "p3.2xlarge"}]}}}
        urn = "urn:pulumi:dev::gpu-training-stack::aws:autoscaling/group:Group::aws-train-asg"
        return analyzer_pb2.AnalyzerResource(type="aws:autoscaling/group:Group", name="aws-train-asg", urn=urn,
                                             properties=_struct(props))

    spot = analyzer.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=[asg(False)]))
    assert not [d for d in spot.diagnostics if d.policyName == "gpu-spot-only"]
    od = analyzer.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=[asg(True)]))
    (diag,) = [d for d in od.diagnostics if d.policyName == "gpu-spot-only"]
    assert diag.enforcementLevel == LEVELS["mandatory"]
    assert "aws-train-asg" in diag.message and diag.urn.endswith("::aws-train-asg")


def _resource(type_: str, name: str, props: dict[str, object], protect: bool = False) -> analyzer_pb2.AnalyzeRequest:
    return analyzer_pb2.AnalyzeRequest(type=type_, name=name, urn=f"urn:pulumi:prod::gpu-training-stack::{type_}::{name}",
                                       properties=_struct(props),
                                       options=analyzer_pb2.AnalyzerResourceOptions(protect=protect))


def test_resource_rules_judge_one_resource_before_it_is_created_and_remediate(
        analyzer: analyzer_pb2_grpc.AnalyzerStub, tmp_path: Path) -> None:
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty())
    kinds = {p.name: p.policy_type for p in info.policies}
    resource_rules = {r.name for r in RULES if r.per_resource is not None}
    assert {"metadata-hardened", "disks-encrypted", "required-tags", "stateful-protected"} <= resource_rules
    assert all(kinds[n] == analyzer_pb2.POLICY_TYPE_RESOURCE for n in resource_rules)
    assert all(kinds[r.name] == analyzer_pb2.POLICY_TYPE_STACK for r in RULES if r.per_resource is None)
    _configure(analyzer, ROOT / "policies" / "prod.json")
    tags = {"owner": "o", "cost-center": "c", "env": "prod"}
    lt = _resource("aws:ec2/launchTemplate:LaunchTemplate", "lt", {
        "metadataOptions": {"httpTokens": "optional"}, "tags": tags,
        "blockDeviceMappings": [{"deviceName": "/dev/sda1", "ebs": {"volumeSize": 200, "encrypted": "false"}}]})
    found = {d.policyName: d for d in analyzer.Analyze(lt).diagnostics}
    assert {"metadata-hardened", "disks-encrypted"} <= set(found)
    assert found["metadata-hardened"].urn.endswith("::lt") and "IMDSv2" in found["metadata-hardened"].message
    # At the remediate level the engine asks the pack for the fixed resource instead.
    remediating = tmp_path / "remediate.json"
    remediating.write_text(json.dumps({**json.loads((ROOT / "policies" / "prod.json").read_text()),
                                       "metadata-hardened": "remediate", "disks-encrypted": "remediate"}))
    _configure(analyzer, remediating)
    fixed = {r.policyName: r.properties for r in analyzer.Remediate(lt).remediations}
    assert fixed["metadata-hardened"]["metadataOptions"]["httpTokens"] == "required"
    assert fixed["disks-encrypted"]["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
    _configure(analyzer, ROOT / "policies" / "prod.json")
    bucket = _resource("aws:s3/bucket:Bucket", "checkpoints", {"bucket": "b", "tags": tags})
    (unprotected,) = [d for d in analyzer.Analyze(bucket).diagnostics if d.policyName == "stateful-protected"]
    assert unprotected.enforcementLevel == LEVELS["mandatory"]
    protected = _resource("aws:s3/bucket:Bucket", "checkpoints", {"bucket": "b", "tags": tags}, protect=True)
    assert not [d for d in analyzer.Analyze(protected).diagnostics if d.policyName == "stateful-protected"]
    untagged = _resource("aws:s3/bucket:Bucket", "raw", {"bucket": "c"}, protect=True)
    assert [d for d in analyzer.Analyze(untagged).diagnostics if d.policyName == "required-tags"]


def test_a_team_stacks_policy_config_holds_it_to_its_quota(analyzer: analyzer_pb2_grpc.AnalyzerStub,
                                                           tmp_path: Path) -> None:
    """Seam registry -> team stack -> `make policy-config` -> the pack as the engine runs it: the
    generated stack's real fleet, within its quota, passes; with the quota halved in the written
    config, team-gpu-quota is a mandatory violation naming the team and the model."""
    from infra.plan.engine import unwrap_secrets
    from tests.harness import by_type, shipped

    out = subprocess.run([sys.executable, "-m", "infra.cli.policy_config", "--stack", "team-vision", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    (asg,) = by_type(list(shipped("team-vision")), "aws:autoscaling/group:Group")
    fleet = analyzer_pb2.AnalyzerResource(
        type=asg.type, name=asg.name, urn=asg.urn, properties=_struct(json.loads(json.dumps(unwrap_secrets(asg.inputs)))))

    def quota_hits() -> list[analyzer_pb2.AnalyzeDiagnostic]:
        found = analyzer.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=[fleet])).diagnostics
        return [d for d in found if d.policyName == "team-gpu-quota"]

    _configure(analyzer, path)
    assert quota_hits() == []
    config = json.loads(path.read_text())
    config["team-gpu-quota"]["gpuQuota"]["aws"]["A100"] = 8
    path.write_text(json.dumps(config))
    _configure(analyzer, path)
    (hit,) = quota_hits()
    assert hit.enforcementLevel == LEVELS["mandatory"]
    assert "team vision" in hit.message and "16 A100 GPUs" in hit.message


def test_a_real_preview_refuses_unroutable_api_sources(analyzer: analyzer_pb2_grpc.AnalyzerStub,
                                                       tmp_path: Path) -> None:
    """Issue 27: the shipped prod stack's kubernetes.apiAccessCidrs (203.0.113.0/24, RFC 5737
    documentation) is advisory in the offline plan only; the pack, with the config `make
    policy-config STACK=prod` writes for a real preview, refuses the EKS cluster as the engine
    sends it, and admits a real public range."""
    from infra.plan.engine import unwrap_secrets
    from infra.resolve.groups import resolve
    from infra.stack.policy_config import for_stack
    from infra.stack.stackfile import project_name, read_stack_file, spec_from_values, stack_path
    from tests.harness import shipped

    path = stack_path("prod")
    spec = spec_from_values(read_stack_file(path, project_name()).values, project_name(), path.name)
    config = tmp_path / "policy-config-prod.json"
    config.write_text(json.dumps(for_stack("prod", resolve(spec))))
    _configure(analyzer, config)
    (eks,) = [r for r in shipped("prod") if r.type == "aws:eks/cluster:Cluster"]
    props = unwrap_secrets(eks.inputs)
    (diag,) = [d for d in analyzer.Analyze(_resource(eks.type, eks.name, props)).diagnostics
               if d.policyName == "kubernetes-api-sources-routable"]
    assert diag.enforcementLevel == LEVELS["mandatory"] and "203.0.113.0/24" in diag.message
    public = {**props, "vpcConfig": {**props["vpcConfig"], "publicAccessCidrs": ["198.51.99.0/24"]}}
    assert not [d for d in analyzer.Analyze(_resource(eks.type, eks.name, public)).diagnostics
                if d.policyName == "kubernetes-api-sources-routable"]

# Each security group / ingress rule type the stack creates (make plan: aws SecurityGroup and vpc
# SecurityGroupIngressRule, Alibaba SecurityGroupRule, Tencent GroupRuleSet) and the other rule
# types the pack reads, opening SSH to the internet in one resource: (type, properties).
def _open_ssh(cidrs: list[str]) -> list[tuple[str, dict[str, object]]]:
    v4 = [c for c in cidrs if ":" not in c]
    v6 = [c for c in cidrs if ":" in c]
    out: list[tuple[str, dict[str, object]]] = [
        ("aws:ec2/securityGroup:SecurityGroup", {"vpcId": "vpc-1", "ingress": [
            {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": v4, "ipv6CidrBlocks": v6}]}),
        ("aws:ec2/securityGroupRule:SecurityGroupRule", {"type": "ingress", "securityGroupId": "sg-1", "protocol": "tcp",
                                                         "fromPort": 22, "toPort": 22, "cidrBlocks": v4,
                                                         "ipv6CidrBlocks": v6}),
        ("tencentcloud:Security/groupRuleSet:GroupRuleSet", {"securityGroupId": "sg-1", "ingresses": [
            {"action": "ACCEPT", "protocol": "TCP", "port": "22", **({"cidrBlock": c} if ":" not in c
                                                                       else {"ipv6CidrBlock": c})} for c in cidrs]}),
    ]
    if len(cidrs) == 1:  # the types that hold one source each
        one = cidrs[0]
        out += [
            ("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", {
                "securityGroupId": "sg-1", "ipProtocol": "tcp", "fromPort": 22, "toPort": 22,
                **({"cidrIpv6": one} if ":" in one else {"cidrIpv4": one})}),
            ("alicloud:ecs/securityGroupRule:SecurityGroupRule", {
                "type": "ingress", "securityGroupId": "sg-1", "ipProtocol": "tcp", "portRange": "22/22",
                **({"ipv6CidrIp": one} if ":" in one else {"cidrIp": one})}),
            ("tencentcloud:Security/groupRule:GroupRule", {"type": "ingress", "securityGroupId": "sg-1",
                                                          "ipProtocol": "tcp", "portRange": "22", "cidrIp": one}),
        ]
    return out


@pytest.mark.parametrize("cidrs", [["0.0.0.0/0"], ["::/0"], ["0.0.0.0/1", "128.0.0.0/1"], ["::/1", "8000::/1"]])
def test_the_pack_alone_flags_each_open_security_group_through_analyze(
        analyzer: analyzer_pb2_grpc.AnalyzerStub, cidrs: list[str]) -> None:
    """The per-resource Analyze call (what runs on each resource before it is created during
    `pulumi up`) flags a security group or rule resource opening SSH to the internet."""
    _configure(analyzer, ROOT / "policies" / "prod.json")
    tags = {"owner": "o", "cost-center": "c", "env": "prod"}
    for type_, props in _open_ssh(cidrs):
        found = [d for d in analyzer.Analyze(_resource(type_, "ssh", {**props, "tags": tags})).diagnostics
                 if d.policyName == "no-public-ingress-rule"]
        assert len(found) == 1, (type_, cidrs)
        assert found[0].enforcementLevel == LEVELS["mandatory"] and found[0].urn.endswith("::ssh")
        assert "whole internet" in found[0].message
    office = _open_ssh(["203.0.113.0/24"])
    assert len(office) == 6
    for type_, props in office:  # an office range passes
        assert not [d for d in analyzer.Analyze(_resource(type_, "ssh", {**props, "tags": tags})).diagnostics
                    if d.policyName == "no-public-ingress-rule"]
