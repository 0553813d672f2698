"""Tencent Cloud network: VPC, a private route table, subnets per zone, the rendezvous stores'
own subnet, NAT gateway with EIP and a default route for egress, and the training security group."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.model import scrape
from infra.model.spec import Network


@dataclass
class TencentNetworkArgs:
    network: Network
    tags: dict[str, str]
    peer_cidrs: list[str] = field(default_factory=list)
    pod_cidrs: list[str] = field(default_factory=list)  # TKE clusters' pod ranges in this VPC
    store_cidr: str = ""  # the rendezvous stores' own subnet (infra/rendezvous.py own_subnet); "" for none
    cluster: bool = True  # it holds a TKE cluster: the cluster's nodes get the training group
    vm_nodes: bool = False  # it holds VM groups: their nodes get the VM group, never the cluster's


class TencentNetwork(pulumi.ComponentResource):
    vpc: tencentcloud.vpc.Instance
    route_table: tencentcloud.route.Table
    subnets: list[tencentcloud.subnet.Instance]
    store_subnet: tencentcloud.subnet.Instance | None  # the rendezvous stores' alone (None without stores)
    security_group: tencentcloud.security.Group | None  # the TKE cluster's (None without one)
    vm_security_group: tencentcloud.security.Group | None  # the VM nodes' (None without VM groups)

    def __init__(self, name: str, args: TencentNetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Network", name, None, opts)
        net, tags = args.network, args.tags
        child = pulumi.ResourceOptions(parent=self)
        self.vpc = tencentcloud.vpc.Instance(f"{name}-vpc", name=f"{name}-vpc", cidr_block=str(net.cidr),
                                             tags=tags, opts=child)
        # One route table for the private subnets: NAT and peering routes go here.
        self.route_table = tencentcloud.route.Table(f"{name}-private-rt", vpc_id=self.vpc.id, name=f"{name}-private",
                                                    tags=tags, opts=child)
        self.subnets = [
            tencentcloud.subnet.Instance(f"{name}-{sub.zone}", name=f"{name}-{sub.zone}", vpc_id=self.vpc.id,
                                         availability_zone=sub.zone, cidr_block=str(sub.cidr),
                                         route_table_id=self.route_table.id, tags=tags, opts=child)
            for sub in net.subnets]
        # The stores' fixed addresses live in a subnet nothing else names (no fleet, pool or mount
        # target), so no node can take a store's address while the store is being replaced. On
        # the private route table like the others: the store pulls its image through NAT.
        self.store_subnet = tencentcloud.subnet.Instance(
            f"{name}-stores", name=f"{name}-stores", vpc_id=self.vpc.id, availability_zone=net.subnets[0].zone,
            cidr_block=args.store_cidr, route_table_id=self.route_table.id, tags=tags,
            opts=child) if args.store_cidr else None
        if net.nat:
            self._nat(name, tags, child)

        self.security_group = self._cluster_group(name, args, tags, child) if args.cluster else None
        self.vm_security_group = self._vm_group(name, args, tags, child) if args.vm_nodes else None
        groups = {k: g.id for k, g in (("securityGroupId", self.security_group),
                                        ("vmSecurityGroupId", self.vm_security_group)) if g is not None}
        self.register_outputs({"vpcId": self.vpc.id, **groups})

    @staticmethod
    def _ssh_and_scrape(net: Network) -> list[tencentcloud.security.GroupRuleSetIngressArgs]:
        rule = tencentcloud.security.GroupRuleSetIngressArgs
        ingresses = [rule(action="ACCEPT", cidr_block=str(c), protocol="TCP", port="22",
                          description="SSH from an allowed CIDR") for c in net.ssh_cidrs]
        # The exporters' ports (infra/model/scrape.py) from the monitoring source alone.
        return ingresses + [rule(action="ACCEPT", cidr_block=c, protocol="TCP", port=str(port),
                                 description="metrics from the monitoring source")
                            for c in scrape.sources(net) for port in scrape.EXPORTER_PORTS]

    @staticmethod
    def _egress() -> list[tencentcloud.security.GroupRuleSetEgressArgs]:
        return [tencentcloud.security.GroupRuleSetEgressArgs(action="ACCEPT", cidr_block="0.0.0.0/0",
                                                             protocol="ALL", description="egress")]

    def _cluster_group(self, name: str, args: TencentNetworkArgs, tags: dict[str, str],
                       child: pulumi.ResourceOptions) -> tencentcloud.security.Group:
        """The TKE cluster's nodes' group: all traffic among members, SSH, the exporters from the
        monitoring source, every other port from peered VPCs and the pod range (pods are fenced
        by NetworkPolicies, infra/k8s/netpol.py). VM nodes never carry it (_vm_group)."""
        net = args.network
        group = tencentcloud.security.Group(
            f"{name}-training-sg", name=f"{name}-training",
            description="GPU training nodes: all traffic among members (NCCL), SSH only from listed CIDRs",
            tags=tags, opts=child)
        rule = tencentcloud.security.GroupRuleSetIngressArgs
        ingresses = [rule(action="ACCEPT", source_security_id=group.id, protocol="ALL",
                          description="NCCL / rendezvous among training nodes")]
        ingresses += self._ssh_and_scrape(net)

        def all_but_exporters(cidr: str, what: str) -> list[tencentcloud.security.GroupRuleSetIngressArgs]:
            tcp = [rule(action="ACCEPT", cidr_block=cidr, protocol="TCP", port=f"{lo}-{hi}", description=what)
                   for lo, hi in scrape.other_tcp_ranges()]
            return tcp + [rule(action="ACCEPT", cidr_block=cidr, protocol=p, port="ALL", description=what)
                          for p in ("UDP", "ICMP")]

        for c in args.peer_cidrs:
            ingresses += all_but_exporters(c, "traffic from a peered VPC (not the exporters' ports)")
        # TKE global-router pods talk across nodes from the pod range; the self-reference above
        # matches node addresses only (TKE "Security group settings": "the container pod network
        # and the cluster node network ... must be open"). The rule set owns every rule of the
        # group, so the cluster's range is added here rather than by the cluster.
        for c in args.pod_cidrs:
            ingresses += all_but_exporters(c, "TKE pod network (not the exporters' ports)")
        tencentcloud.security.GroupRuleSet(
            f"{name}-training-rules", security_group_id=group.id, ingresses=ingresses, egresses=self._egress(),
            opts=pulumi.ResourceOptions(parent=group))
        return group

    def _vm_group(self, name: str, args: TencentNetworkArgs, tags: dict[str, str],
                  child: pulumi.ResourceOptions) -> tencentcloud.security.Group:
        """The VM nodes' group: SSH from the listed CIDRs and the exporters from the monitoring
        source, nothing else — not its own members, not the TKE pod range, not a peered VPC: the
        nodes of one run reach each other through their run's group alone (run_group)."""
        group = tencentcloud.security.Group(
            f"{name}-vm-sg", name=f"{name}-vm",
            description="GPU VM nodes: SSH from listed CIDRs, metrics from the monitoring source, nothing else",
            tags=tags, opts=child)
        tencentcloud.security.GroupRuleSet(
            f"{name}-vm-rules", security_group_id=group.id, ingresses=self._ssh_and_scrape(args.network),
            egresses=self._egress(), opts=pulumi.ResourceOptions(parent=group))
        return group

    def run_group(self, group: str, fabric: bool, tags: dict[str, str]) -> pulumi.Output[str]:
        """A multi-node VM group's own security group: all traffic among its nodes (the
        collectives, torch's worker store), by reference to itself, from nothing else. Its egress
        is the VM group's (orderly groups: a packet no rule of this group matches goes on to the
        next group's rules, CVM "Security group overview")."""
        del fabric  # HCC's RDMA network is not governed by security groups (shared/FABRIC_AND_HEALTH.md)
        run = tencentcloud.security.Group(
            f"{group}-run-sg", name=f"{group}-run",
            description=scrape.run_group_description(group),
            tags=tags, opts=pulumi.ResourceOptions(parent=self))
        tencentcloud.security.GroupRuleSet(
            f"{group}-run-rules", security_group_id=run.id,
            ingresses=[tencentcloud.security.GroupRuleSetIngressArgs(
                action="ACCEPT", source_security_id=run.id, protocol="ALL",
                description=f"collectives among the nodes of {group}")],
            opts=pulumi.ResourceOptions(parent=run))
        return run.id

    def _nat(self, name: str, tags: dict[str, str], child: pulumi.ResourceOptions) -> None:
        """A NAT gateway with its EIP and the private route table's default route through it."""
        eip = tencentcloud.eip.Instance(f"{name}-nat-eip", name=f"{name}-nat",
                                        internet_charge_type="TRAFFIC_POSTPAID_BY_HOUR",
                                        internet_max_bandwidth_out=200, tags=tags, opts=child)
        nat = tencentcloud.nat.Gateway(f"{name}-nat", name=f"{name}-nat", vpc_id=self.vpc.id, bandwidth=200,
                                       max_concurrent=1000000, assigned_eip_sets=[eip.public_ip], tags=tags,
                                       opts=child)
        tencentcloud.route.TableEntry(f"{name}-default", route_table_id=self.route_table.id,
                                      destination_cidr_block="0.0.0.0/0", next_type="NAT", next_hub=nat.id,
                                      description="egress through NAT", opts=child)
