"""Alibaba Cloud network: VPC, vSwitches per zone, enhanced NAT gateway with EIP and SNAT, and
the training security group."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_alicloud as alicloud

from infra.spec import Network


@dataclass
class AlicloudNetworkArgs:
    network: Network
    tags: dict[str, str]
    peer_cidrs: list[str] = field(default_factory=list)


class AlicloudNetwork(pulumi.ComponentResource):
    vpc: alicloud.vpc.Network
    switches: list[alicloud.vpc.Switch]
    security_group: alicloud.ecs.SecurityGroup

    def __init__(self, name: str, args: AlicloudNetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Network", name, None, opts)
        net, tags = args.network, args.tags
        child = pulumi.ResourceOptions(parent=self)
        self.vpc = alicloud.vpc.Network(f"{name}-vpc", vpc_name=f"{name}-vpc", cidr_block=str(net.cidr),
                                        tags=tags, opts=child)
        self.switches = [
            alicloud.vpc.Switch(f"{name}-{sub.zone}", vswitch_name=f"{name}-{sub.zone}", vpc_id=self.vpc.id,
                                zone_id=sub.zone, cidr_block=str(sub.cidr), tags=tags, opts=child)
            for sub in net.subnets]
        if net.nat:
            # An enhanced NAT gateway adds the 0.0.0.0/0 route to the VPC's system route table
            # itself; SNAT gives every vSwitch egress through one EIP.
            nat = alicloud.vpc.NatGateway(f"{name}-nat", vpc_id=self.vpc.id, vswitch_id=self.switches[0].id,
                                          nat_gateway_name=f"{name}-nat", nat_type="Enhanced",
                                          payment_type="PayAsYouGo", network_type="internet", tags=tags, opts=child)
            eip = alicloud.ecs.EipAddress(f"{name}-nat-eip", address_name=f"{name}-nat", bandwidth="200",
                                          internet_charge_type="PayByTraffic", payment_type="PayAsYouGo",
                                          tags=tags, opts=child)
            bind = alicloud.ecs.EipAssociation(f"{name}-nat-eip-bind", allocation_id=eip.id, instance_id=nat.id,
                                               instance_type="Nat", opts=child)
            for sub, switch in zip(net.subnets, self.switches):
                alicloud.vpc.SnatEntry(f"{name}-snat-{sub.zone}", snat_table_id=nat.snat_table_ids,
                                       source_vswitch_id=switch.id, snat_ip=eip.ip_address,
                                       opts=pulumi.ResourceOptions(parent=self, depends_on=[bind]))

        self.security_group = alicloud.ecs.SecurityGroup(
            f"{name}-training-sg", vpc_id=self.vpc.id, security_group_name=f"{name}-training",
            security_group_type="normal",
            description="GPU training nodes: all traffic among members (NCCL), SSH only from listed CIDRs",
            tags=tags, opts=child)
        sg = pulumi.ResourceOptions(parent=self.security_group)
        alicloud.ecs.SecurityGroupRule(f"{name}-training-self", type="ingress", ip_protocol="all",
                                       port_range="-1/-1", security_group_id=self.security_group.id,
                                       source_security_group_id=self.security_group.id, policy="accept",
                                       description="NCCL / rendezvous among training nodes", opts=sg)
        for i, cidr in enumerate(net.ssh_cidrs):
            alicloud.ecs.SecurityGroupRule(f"{name}-ssh-{i}", type="ingress", ip_protocol="tcp", port_range="22/22",
                                           security_group_id=self.security_group.id, cidr_ip=str(cidr),
                                           policy="accept", description="SSH from an allowed CIDR", opts=sg)
        for i, peer in enumerate(args.peer_cidrs):
            alicloud.ecs.SecurityGroupRule(f"{name}-peer-{i}", type="ingress", ip_protocol="all", port_range="-1/-1",
                                           security_group_id=self.security_group.id, cidr_ip=peer, policy="accept",
                                           description="traffic from a peered VPC", opts=sg)
        alicloud.ecs.SecurityGroupRule(f"{name}-egress", type="egress", ip_protocol="all", port_range="-1/-1",
                                       security_group_id=self.security_group.id, cidr_ip="0.0.0.0/0",
                                       policy="accept", description="egress", opts=sg)
        self.register_outputs({"vpcId": self.vpc.id, "securityGroupId": self.security_group.id})
