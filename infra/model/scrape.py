"""Who may scrape a VM node's exporters: the monitoring source of its network
(`networks[].scrapeCidrs`, default: the network's own CIDR), never a peered network or the TKE
pod range. The training security groups admit EXPORTER_PORTS from those sources alone, and
admit peers and pod ranges to every other port (TCP_OTHER ranges, UDP, ICMP) instead of to
all traffic."""

from __future__ import annotations

from infra.model.spec import Network

NODE_EXPORTER, DCGM_EXPORTER = 9100, 9400
METRICS_PORT = 9401  # the trainer's own metrics (infra/contract.py hands it to the trainer)
EXPORTER_PORTS = (NODE_EXPORTER, DCGM_EXPORTER, METRICS_PORT)  # METRICS_PORT: the trainer's


def sources(net: Network) -> list[str]:
    """The CIDRs admitted to the exporters' ports: scrapeCidrs, else the network's own CIDR."""
    return [str(c) for c in net.scrape_cidrs] or [str(net.cidr)]


def other_tcp_ranges(ports: tuple[int, ...] = EXPORTER_PORTS) -> list[tuple[int, int]]:
    """TCP 1-65535 less `ports`, as inclusive (from, to) ranges."""
    ranges, start = [], 1
    for port in sorted(set(ports)):
        if port > start:
            ranges.append((start, port - 1))
        start = port + 1
    if start <= 65535:
        ranges.append((start, 65535))
    return ranges


def run_group_description(group: str) -> str:
    """A multi-node group's own security group, the same words on every cloud; at most 70
    characters for a 32-character group name, inside Tencent's 100 (resource_tc_security_group.go)."""
    return f"Nodes of {group}: all traffic among them only"
