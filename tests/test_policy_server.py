"""The policy pack as the Pulumi engine runs it: `policies/__main__.py` starts the analyzer
gRPC server; this test speaks the engine's protocol to it (GetAnalyzerInfo, Configure with
policies/dev.json, AnalyzeStack) instead of importing the module."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

from policies.rules import RULES

ROOT = Path(__file__).resolve().parents[1]
LEVELS = {"advisory": analyzer_pb2.ADVISORY, "mandatory": analyzer_pb2.MANDATORY, "disabled": analyzer_pb2.DISABLED}


@pytest.fixture(scope="module")
def analyzer() -> Iterator[analyzer_pb2_grpc.AnalyzerStub]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "policies" / "__main__.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
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
    for rule in RULES:
        entry = json.loads(path.read_text()).get(rule.name, {})
        settings = entry if isinstance(entry, dict) else {"enforcementLevel": entry}
        level = settings.get("enforcementLevel", rule.enforcement)
        props = {k: v for k, v in settings.items() if k != "enforcementLevel"}
        config[rule.name] = analyzer_pb2.PolicyConfig(enforcementLevel=LEVELS[level], properties=_struct(props))
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
