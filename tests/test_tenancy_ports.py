"""Issue 41: a multi-node VM run's collective and worker-store ports are reachable from the
nodes of that run alone. Walks every ingress rule of every security group a run's nodes carry in
the shipped plans (all three clouds): the only source on any port other than SSH and the
exporters is the run's own group, by reference; no peered network, pod range, cluster group or
other run. No other node, pool or cluster carries a run's group or a VM group."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.tenancy_helpers import fleet_groups, ingress_rules

SSH = 22


def tcp_ports(rule: dict[str, Any]) -> set[int] | None:
    """The TCP ports a CIDR rule opens, or None when it opens more than a few (or other protocols)."""
    proto, port = str(rule["protocol"]).lower(), rule["port"]
    if proto != "tcp":
        return None
    if isinstance(port, (tuple, list)):
        lo, hi = int(port[0]), int(port[1])
    elif "/" in str(port):
        lo, hi = (int(x) for x in str(port).split("/"))
    elif str(port).isdigit():
        lo = hi = int(port)
    else:
        return None
    return set(range(lo, hi + 1)) if hi - lo < 8 else None


def node_groups_of(inputs: dict[str, Any]) -> list[str]:
    found = fleet_groups(inputs)
    return list(dict.fromkeys([*found, *(inputs.get("orderlySecurityGroupIds") or [])]))


def walk(stack: str) -> tuple[list[Any], dict[str, list[str]], dict[str, dict[str, Any]]]:
    """The plan's resources, each node-starting resource's groups, and the networks' settings."""
    from infra.plan.engine import unwrap_secrets
    from tests.harness import parse_spec, shipped, spec_raw, stack_values

    resources = list(shipped(stack))
    carried = {r.name: node_groups_of(unwrap_secrets(r.inputs)) for r in resources}
    spec = parse_spec(spec_raw(stack_values(stack)))
    nets = {n.name: {"ssh": {str(c) for c in n.ssh_cidrs},
                     "scrape": {str(c) for c in n.scrape_cidrs} or {str(n.cidr)}} for n in spec.networks}
    return resources, {k: v for k, v in carried.items() if v}, nets


def check_run(resources: list[Any], carried: dict[str, list[str]], nets: dict[str, dict[str, Any]],
              run_sg: str) -> None:
    """Every rule of every group that the run's nodes carry admits the run itself, or SSH / the
    exporters from the network's listed sources; nothing else."""
    from infra.model.scrape import EXPORTER_PORTS

    nodes = [name for name, groups in carried.items() if run_sg in groups]
    assert nodes, f"no node carries {run_sg}"
    for name in nodes:
        for sg in carried[name]:
            net = sg.removesuffix("-vm-sg-id")
            for rule in ingress_rules(resources, sg):
                assert "unknown" not in rule, (sg, rule)
                if rule["source"] is not None:
                    assert rule["source"] == sg == run_sg, f"{name}: {sg} admits {rule['source']}"
                    continue
                ports = tcp_ports(rule)
                assert ports is not None, f"{name}: {sg} admits {rule['cidr']} on {rule['protocol']} {rule['port']}"
                allowed = ({SSH} if rule["cidr"] in nets[net]["ssh"] else set()) | (
                    set(EXPORTER_PORTS) if rule["cidr"] in nets[net]["scrape"] else set())
                assert ports <= allowed, f"{name}: {sg} admits {rule['cidr']} on {sorted(ports)}"


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_a_runs_ports_admit_only_its_own_nodes(stack: str) -> None:
    from infra.plan.engine import unwrap_secrets

    resources, carried, nets = walk(stack)
    runs = sorted({g for groups in carried.values() for g in groups if g.endswith("-run-sg-id")})
    if stack == "prod":
        assert runs == ["ali-train-run-sg-id", "aws-train-run-sg-id", "tc-train-run-sg-id"], runs
    for run_sg in runs:
        check_run(resources, carried, nets, run_sg)
    for name, groups in carried.items():
        assert len([g for g in groups if g.endswith("-run-sg-id")]) <= 1, (name, groups)
        if any(g.endswith("-training-sg-id") for g in groups):  # a cluster's nodes
            assert not any(g.endswith(("-run-sg-id", "-vm-sg-id")) for g in groups), (name, groups)
    # Alibaba: a basic group lets its members talk unless its internal policy is Drop.
    for r in resources:
        if r.type == "alicloud:ecs/securityGroup:SecurityGroup" and r.name.endswith("-vm-sg"):
            assert unwrap_secrets(r.inputs).get("innerAccessPolicy") == "Drop", r.name
    # A cluster's own groups are not on any VM node (the ACK cluster's nodes and pods, EKS, TKE).
    clusters = [r for r in resources if r.type.endswith(("eks/cluster:Cluster", "cs/managedKubernetes:ManagedKubernetes"))]
    for c in clusters:
        assert not re.findall(r"[\w-]+-(?:vm|run)-sg-id", json.dumps(unwrap_secrets(c.inputs))), c.name


def test_the_walk_catches_the_old_layout() -> None:
    """The check fails on the rules the plan had before issue 41: the training group admitted its
    own members (every run and the clusters' pods), peered VPCs and the TKE pod range."""
    from infra.plan.engine import Registered

    resources, carried, nets = walk("prod")

    run_sg = "aws-train-run-sg-id"
    for bad in ({"referencedSecurityGroupId": "aws-train-vm-sg-id", "ipProtocol": "-1"},
                {"cidrIpv4": "10.20.0.0/16", "ipProtocol": "tcp", "fromPort": 1, "toPort": 9099},
                {"cidrIpv4": "10.20.0.0/16", "ipProtocol": "udp", "fromPort": 0, "toPort": 65535}):
        fake = Registered("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "injected", "urn", "", True,
                          "", {"securityGroupId": "aws-train-vm-sg-id", **bad})
        with pytest.raises(AssertionError):
            check_run([*resources, fake], carried, nets, run_sg)


def test_a_run_group_of_a_32_character_group_fits_tencents_limits(tmp_path: Any) -> None:
    """Tencent takes a security group name of 1-60 characters and a description of 1-100
    (resource_tc_security_group.go); group names may have 32."""
    from infra.plan.engine import unwrap_secrets
    from tests.harness import key, run_stack

    long_name = "tc-" + "x" * 29

    def edit(values: dict[str, Any]) -> None:
        for g in values[key("nodeGroups")]:
            if g["name"] == "tc-train":
                g["name"] = long_name

    groups = [unwrap_secrets(r.inputs) for r in run_stack("prod", edit, tmp_path)
              if r.type == "tencentcloud:Security/group:Group"]
    assert any(long_name in g["name"] for g in groups)
    for g in groups:
        assert 1 <= len(g["name"]) <= 60 and 1 <= len(g["description"]) <= 100, g
