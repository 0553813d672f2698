"""Where the nodes of a multi-node VM run meet: a rendezvous store (training/node/rdzv_store.py, in
the trainer image) on a small on-demand instance, one per multi-node VM group, at a fixed
private address nothing else can take: on AWS in a range of the network's first subnet that
the stack reserves for its stores (STORE_RANGE, an explicit subnet CIDR reservation: EC2 hands it
to no node, pod or mount target); on Alibaba and Tencent, whose reservations cannot hold an
instance's primary address, in a vSwitch / subnet of the stores' own (`own_subnet`) that no
fleet, pool, pod vSwitch, mount target or NAT gateway names. It runs apart from the GPU nodes,
so a spot reclaim of any of them leaves the run alive (torchrun `--nnodes MIN:MAX`,
is_host=false), and its address never changes across replacements, so nodes find it from their
user data.

One store per group, not per network: the store has no authentication, so it is kept to its own
group by the network (its security group admits that group's nodes alone, by security-group
reference), and what the agents read from it is signed with the group's key
(training/node/rdzv_launch.py), which the stack gives that group's nodes only.

A stack may name its own store instead (`training.rendezvousEndpoint`, host:port). Kubernetes
Jobs get theirs from the cluster (infra/k8s/job.py)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from infra.clouds import profile, profiles
from infra.core import catalog as cat
from infra.model.spec import Network, NodeGroup, StackSpec
from infra.resolve.resolved import ResolvedGroup

PORT = 29400
DISK_GB = 80  # the trainer image (it carries the store's torch) with room for one more
# The stores' range: the /28 at offset 16 of the network's first subnet (clouds keep the first
# addresses of a subnet for themselves: AWS 4, Alibaba and Tencent fewer), one address per group.
STORE_RANGE_OFFSET = 16
STORE_RANGE_PREFIX = 28
MAX_STORES = 2 ** (32 - STORE_RANGE_PREFIX)
# Alibaba and Tencent: the stores' own vSwitch / subnet, the lowest free /28 of the VPC in the
# first subnet's zone. Alibaba keeps a vSwitch's first address and last three (VPC CreateVSwitch);
# the stores take offsets 4..11, clear of the first four and last four of either cloud.
OWN_SUBNET_CLOUDS = tuple(p.name for p in profiles() if p.stores_own_subnet)
OWN_SUBNET_PREFIX = 28
OWN_SUBNET_FIRST = 4
OWN_SUBNET_STORES = 8
KEY_LENGTH = 48  # characters of a group's rendezvous key (training/node/rdzv_launch.py MIN_KEY_CHARS)


@dataclass(frozen=True)
class Site:
    """One store: the network it serves and its address there."""

    cloud: str
    network: str
    address: str
    zone: str
    groups: tuple[str, ...]
    subnet: str = ""  # the stores' own vSwitch / subnet (Alibaba, Tencent); "" on AWS (first subnet)

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
    """A VM training group whose run may span nodes (infra/resolve/groups.py max_nodes)."""
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


def taken_ranges(spec: StackSpec, net: Network) -> list[ipaddress.IPv4Network]:
    """What the stack places in a network's VPC besides the stores: its subnets and, with an ACK
    cluster there, Terway's pod vSwitches. (The clusters' pod and service ranges lie outside
    every VPC: infra/checks/cloud_rules.py refuses a network that overlaps them.)"""
    taken = [s.cidr for s in net.subnets]
    if any(g.network == net.name and g.kind == "kubernetes" for g in spec.node_groups):
        taken += profile(net.cloud).kubernetes_pod_subnets(net.cidr, taken)  # as many as there is room for
    return taken


def own_subnet(spec: StackSpec, net: Network) -> str | None:
    """The stores' own vSwitch / subnet of an Alibaba or Tencent network: the lowest /28 of the
    VPC clear of everything else the stack places there (None: there is none)."""
    taken = taken_ranges(spec, net)
    size = 2 ** (32 - max(OWN_SUBNET_PREFIX, net.cidr.prefixlen))
    start, end = int(net.cidr.network_address), int(net.cidr.broadcast_address)
    at = start
    while at + size - 1 <= end:  # the blocks in order; past a taken range at once, not block by block
        block = ipaddress.IPv4Network((at, 32 - (size - 1).bit_length()))
        hit = next((t for t in taken if block.overlaps(t)), None)
        if hit is None:
            return str(block)
        after = int(hit.broadcast_address) + 1  # every block up to the range's end overlaps it
        at = start + -(-(after - start) // size) * size
    return None


def stores_in(spec: StackSpec, net: Network) -> int:
    """How many stores a network would hold (its multi-node VM groups; none with a named store)."""
    if spec.training.rendezvous_endpoint:
        return 0
    return sum(1 for g in spec.node_groups if g.network == net.name and multi_node_spec(g))


def _place(spec: StackSpec, group: NodeGroup) -> tuple[str, str]:
    """A group's store address, and the stores' own subnet where the cloud needs one."""
    net = spec.network(group.network)
    if net.cloud not in OWN_SUBNET_CLOUDS:
        return address(str(net.subnets[0].cidr), slot(spec, group)), ""
    own = own_subnet(spec, net)
    at = slot(spec, group)
    if own is None or at >= OWN_SUBNET_STORES:  # infra/checks/cloud_rules.py refuses such a spec first
        raise ValueError(f"network {net.name} has no room for the store of {group.name}")
    return str(ipaddress.ip_network(own).network_address + OWN_SUBNET_FIRST + at), own


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
            at, own = _place(spec, g)
            out.append(Site(g.cloud, g.network, at, first.zone, (g.name,), own))
    return out


def endpoint_for(spec: StackSpec, rg: ResolvedGroup) -> str:
    """RDZV_ENDPOINT of a VM group's nodes ("" for a single-node run)."""
    if not multi_node_vm(rg):
        return ""
    if spec.training.rendezvous_endpoint:
        return spec.training.rendezvous_endpoint
    return f"{_place(spec, rg.group)[0]}:{PORT}"


def instance(cloud: str) -> dict[str, Any]:
    """The store's instance type and price (infra/data/rendezvous.yaml)."""
    return cat.load_rendezvous()[cloud]
