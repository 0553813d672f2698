"""Where the nodes of a multi-node VM run meet: a rendezvous store (training/rdzv_store.py, in
the trainer image) on a small on-demand instance, one per network with such groups, at a fixed
private address: the tenth of the network's first subnet. It runs apart from the GPU nodes, so
a spot reclaim of any of them leaves the run alive (torchrun `--nnodes MIN:MAX`, is_host=false),
and its address never changes across replacements, so nodes find it from their user data.

A stack may name its own store instead (`training.rendezvousEndpoint`, host:port). Kubernetes
Jobs get theirs from the cluster (infra/k8s/job.py)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infra import catalog as cat
from infra.spec import StackSpec

if TYPE_CHECKING:
    from infra.groups import ResolvedGroup

PORT = 29400
DISK_GB = 80  # the trainer image (it carries the store's torch) with room for one more
HOST_OFFSET = 10  # clouds reserve the first addresses of a subnet (AWS 4, Alibaba and Tencent fewer)


@dataclass(frozen=True)
class Site:
    """One store: the network it serves and its address there."""

    cloud: str
    network: str
    address: str
    zone: str
    groups: tuple[str, ...]

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{PORT}"

    @property
    def name(self) -> str:
        return f"rdzv-{self.network}"


def multi_node_vm(rg: ResolvedGroup) -> bool:
    return rg.kind == "vm" and rg.workload == "training" and rg.max_nodes > 1


def address(subnet_cidr: str) -> str:
    return str(ipaddress.ip_network(subnet_cidr).network_address + HOST_OFFSET)


def sites(spec: StackSpec, groups: Iterable[ResolvedGroup]) -> list[Site]:
    """The stores the stack creates: none when the spec names its own."""
    if spec.training.rendezvous_endpoint:
        return []
    by_network: dict[str, list[str]] = {}
    for rg in groups:
        if multi_node_vm(rg):
            by_network.setdefault(rg.network, []).append(rg.name)
    out = []
    for net_name, names in sorted(by_network.items()):
        net = spec.network(net_name)
        first = net.subnets[0]
        out.append(Site(net.cloud, net_name, address(str(first.cidr)), first.zone, tuple(names)))
    return out


def endpoint_for(spec: StackSpec, rg: ResolvedGroup) -> str:
    """RDZV_ENDPOINT of a VM group's nodes ("" for a single-node run)."""
    if not multi_node_vm(rg):
        return ""
    if spec.training.rendezvous_endpoint:
        return spec.training.rendezvous_endpoint
    net = spec.network(rg.network)
    return f"{address(str(net.subnets[0].cidr))}:{PORT}"


def instance(cloud: str) -> dict[str, Any]:
    """The store's instance type and price (infra/data/rendezvous.yaml)."""
    return cat.load_rendezvous()[cloud]
