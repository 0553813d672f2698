"""Where the nodes of a multi-node VM run meet: a rendezvous store (training/rdzv_store.py, in
the trainer image) on a small on-demand instance, one per multi-node VM group, at a fixed
private address in a range of the network's first subnet that the stack reserves for its stores
(STORE_RANGE: the cloud never hands it to nodes, pods or mount targets). It runs apart from the
GPU nodes, so a spot reclaim of any of them leaves the run alive (torchrun `--nnodes MIN:MAX`,
is_host=false), and its address never changes across replacements, so nodes find it from their
user data.

One store per group, not per network: the store has no authentication, so it is kept to its own
group by the network (its security group admits that group's nodes alone, by security-group
reference), and what the agents read from it is signed with the group's key
(training/rdzv_launch.py), which the stack gives that group's nodes only.

A stack may name its own store instead (`training.rendezvousEndpoint`, host:port). Kubernetes
Jobs get theirs from the cluster (infra/k8s/job.py)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infra import catalog as cat
from infra.spec import NodeGroup, StackSpec

if TYPE_CHECKING:
    from infra.groups import ResolvedGroup

PORT = 29400
DISK_GB = 80  # the trainer image (it carries the store's torch) with room for one more
# The stores' range: the /28 at offset 16 of the network's first subnet (clouds keep the first
# addresses of a subnet for themselves: AWS 4, Alibaba and Tencent fewer), one address per group.
STORE_RANGE_OFFSET = 16
STORE_RANGE_PREFIX = 28
MAX_STORES = 2 ** (32 - STORE_RANGE_PREFIX)
KEY_LENGTH = 48  # characters of a group's rendezvous key (training/rdzv_launch.py MIN_KEY_CHARS)


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
    def group(self) -> str:
        return self.groups[0]

    @property
    def name(self) -> str:
        return f"rdzv-{self.group}"


def multi_node_spec(group: NodeGroup) -> bool:
    """A VM training group whose run may span nodes (infra/groups.py max_nodes)."""
    return group.kind == "vm" and group.workload == "training" and group.scaling.max > 1


def multi_node_vm(rg: ResolvedGroup) -> bool:
    return multi_node_spec(rg.group)


def slot(spec: StackSpec, group: NodeGroup) -> int:
    """A group's place among its network's multi-node VM groups, in spec order."""
    names = [g.name for g in spec.node_groups if g.network == group.network and multi_node_spec(g)]
    return names.index(group.name)


def store_range(subnet_cidr: str) -> str:
    """The reserved range of the stores in a network's first subnet."""
    base = ipaddress.ip_network(subnet_cidr).network_address + STORE_RANGE_OFFSET
    return str(ipaddress.ip_network(f"{base}/{STORE_RANGE_PREFIX}"))


def address(subnet_cidr: str, slot: int = 0) -> str:
    if not 0 <= slot < MAX_STORES:
        raise ValueError(f"a network holds at most {MAX_STORES} multi-node VM groups' stores (slot {slot})")
    return str(ipaddress.ip_network(store_range(subnet_cidr)).network_address + slot)


def sites(spec: StackSpec, groups: Iterable[ResolvedGroup]) -> list[Site]:
    """The stores the stack creates, one per multi-node VM group: none when the spec names its
    own. A group's slot is its place among its network's multi-node VM groups in spec order."""
    if spec.training.rendezvous_endpoint:
        return []
    chosen = {rg.name for rg in groups if multi_node_vm(rg)}
    out = []
    for g in spec.node_groups:
        if g.name in chosen:
            first = spec.network(g.network).subnets[0]
            out.append(Site(g.cloud, g.network, address(str(first.cidr), slot(spec, g)), first.zone, (g.name,)))
    return out


def endpoint_for(spec: StackSpec, rg: ResolvedGroup) -> str:
    """RDZV_ENDPOINT of a VM group's nodes ("" for a single-node run)."""
    if not multi_node_vm(rg):
        return ""
    if spec.training.rendezvous_endpoint:
        return spec.training.rendezvous_endpoint
    net = spec.network(rg.network)
    return f"{address(str(net.subnets[0].cidr), slot(spec, rg.group))}:{PORT}"


def instance(cloud: str) -> dict[str, Any]:
    """The store's instance type and price (infra/data/rendezvous.yaml)."""
    return cat.load_rendezvous()[cloud]
