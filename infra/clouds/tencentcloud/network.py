"""Tencent Cloud network: VPC, a private route table, subnets per zone, the rendezvous stores'
own subnet, NAT gateway with EIP and a default route for egress, and the training security group."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra import scrape
from infra.spec import Network


@dataclass
class TencentNetworkArgs:
    network: Network
    tags: dict[str, str]
    peer_cidrs: list[str] = field(default_factory=list)
    pod_cidrs: list[str] = field(default_factory=list)  # TKE clusters' pod ranges in this VPC
    store_cidr: str = ""  # the rendezvous stores' own subnet (infra/rendezvous.py own_subnet); "" for none


class TencentNetwork(pulumi.ComponentResource):
    vpc: tencentcloud.vpc.Instance
    route_table: tencentcloud.route.Table
    subnets: list[tencentcloud.subnet.Instance]
    store_subnet: tencentcloud.subnet.Instance | None  # the rendezvous stores' alone (None without stores)
    security_group: tencentcloud.security.Group

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

        self.security_group = tencentcloud.security.Group(
            f"{name}-training-sg", name=f"{name}-training",
            description="GPU training nodes: all traffic among members (NCCL), SSH only from listed CIDRs",
            tags=tags, opts=child)
        rule = tencentcloud.security.GroupRuleSetIngressArgs
        ingresses = [rule(action="ACCEPT", source_security_id=self.security_group.id, protocol="ALL",
                          description="NCCL / rendezvous among training nodes")]
        ingresses += [rule(action="ACCEPT", cidr_block=str(c), protocol="TCP", port="22",
                           description="SSH from an allowed CIDR") for c in net.ssh_cidrs]
        # The exporters' ports (infra/scrape.py) from the monitoring source alone; peered VPCs and
        # the pod range get every other port.
        ingresses += [rule(action="ACCEPT", cidr_block=c, protocol="TCP", port=str(port),
                           description="metrics from the monitoring source")
                      for c in scrape.sources(net) for port in scrape.EXPORTER_PORTS]

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
            f"{name}-training-rules", security_group_id=self.security_group.id, ingresses=ingresses,
            egresses=[tencentcloud.security.GroupRuleSetEgressArgs(action="ACCEPT", cidr_block="0.0.0.0/0",
                                                                   protocol="ALL", description="egress")],
            opts=pulumi.ResourceOptions(parent=self.security_group))
        self.register_outputs({"vpcId": self.vpc.id, "securityGroupId": self.security_group.id})

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
