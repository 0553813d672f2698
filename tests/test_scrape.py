"""VM nodes' exporters (9100 node, 9400 DCGM, the trainer's 9401) admitted only from the
monitoring source (networks[].scrapeCidrs, default the network's own CIDR): every rule of
every training security group that opens one of those ports comes from the source or the
group itself, never a peered network or a pod range; peers still reach every other port of a
cluster's nodes (VM nodes: none, tests/test_tenancy_ports.py)."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from infra.model.scrape import EXPORTER_PORTS
from tests.tenancy_helpers import ingress_rules

ALL = (0, 65535)


def port_span(cloud: str, rule: dict[str, Any]) -> tuple[int, int]:
    """The TCP ports a rule opens (all for an all-protocols rule; none for UDP / ICMP)."""
    proto, port = str(rule["protocol"]).lower(), rule["port"]
    if proto in ("-1", "all"):
        return ALL
    if proto != "tcp":
        return (1, 0)
    if cloud == "aws":
        return int(port[0]), int(port[1])
    if cloud == "alicloud":
        lo, hi = port.split("/")
        return int(lo), int(hi)
    if port == "ALL":
        return ALL
    lo, _, hi = port.partition("-")
    return int(lo), int(hi or lo)


def opened_exporters(resources: list[Any], stack_sources: dict[str, list[str]]) -> dict[str, list[dict[str, Any]]]:
    """Per training security group: the rules that open an exporter port, with the group's own
    name and its network's sources."""
    found = {}
    for sg in [r for r in resources if r.name.endswith(("-training-sg", "-vm-sg"))]:
        cloud = sg.type.split(":")[0]
        rules = ingress_rules(resources, f"{sg.name}-id")
        assert rules and not any("unknown" in r for r in rules), (sg.name, rules)
        found[sg.name] = [r for r in rules
                          if any(port_span(cloud, r)[0] <= p <= port_span(cloud, r)[1] for p in EXPORTER_PORTS)]
    return found


def check(resources: list[Any], sources: dict[str, list[str]]) -> None:
    for sg_name, rules in opened_exporters(resources, sources).items():
        net = sg_name.removesuffix("-training-sg").removesuffix("-vm-sg")
        for r in rules:
            assert r["source"] == f"{sg_name}-id" or r["cidr"] in sources[net], (sg_name, r)
        # Each exporter port is admitted from each source, by its own rule.
        cloud = next(x for x in resources if x.name == sg_name).type.split(":")[0]
        for port in EXPORTER_PORTS:
            assert {r["cidr"] for r in rules if port_span(cloud, r) == (port, port)} == set(sources[net]), (sg_name, port)


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_exporters_are_admitted_from_the_networks_own_cidr_alone(stack: str) -> None:
    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped

    resources = list(shipped(stack))
    vpcs = {r.name.removesuffix("-vpc"): unwrap_secrets(r.inputs).get("cidrBlock") for r in resources
            if r.name.endswith("-vpc") and "cidrBlock" in unwrap_secrets(r.inputs)}
    check(resources, {n: [c] for n, c in vpcs.items()})
    assert any(r.name.endswith("-vm-sg") for r in resources), "the VM nodes' groups are checked too"
    if stack == "prod":
        # Peers and the TKE pod range still reach every other port (NCCL, the stores' clients, SSH...).
        training = [r for r in resources if r.name.endswith("-training-sg")]
        assert training, "prod's clusters have training groups: the loop below must check something"
        for sg in training:
            others = [r for r in ingress_rules(resources, f"{sg.name}-id")
                      if r["cidr"] and r["cidr"] != vpcs[sg.name.removesuffix("-training-sg")]]
            assert others, sg.name


def test_scrape_cidrs_replace_the_default_and_peers_are_refused(tmp_path: Any) -> None:
    from tests.harness import key, run_stack

    monitoring = {}

    def edit(values: dict[str, Any]) -> None:
        for i, net in enumerate(values[key("networks")]):
            cidr = str(list(ipaddress.ip_network(net["cidr"]).subnets(new_prefix=28))[-1])
            net["scrapeCidrs"] = [cidr]
            monitoring[net["name"]] = [cidr]

    resources = run_stack("prod", edit, tmp_path)
    check(resources, monitoring)


def test_a_peer_rule_on_an_exporter_port_is_caught() -> None:
    """The check fails on the old rule (all traffic from a peered VPC)."""
    from tests.harness import shipped

    resources = list(shipped("prod"))
    rules = opened_exporters(resources, {})
    assert all(rules.values())
    fake = {"source": None, "cidr": "10.99.0.0/16", "port": (None, None), "protocol": "-1"}
    assert port_span("aws", fake) == ALL and port_span("tencentcloud", {"protocol": "ALL", "port": None}) == ALL
    assert port_span("tencentcloud", {"protocol": "TCP", "port": "9101-9399"}) == (9101, 9399)
