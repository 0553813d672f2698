"""Alibaba Cloud network: VPC, vSwitches per zone, the rendezvous stores' own vSwitch, enhanced
NAT gateway with EIP and SNAT, and the training security group."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_alicloud as alicloud

from infra.clouds.alicloud.profile import pod_switch_cidrs
from infra.model import scrape
from infra.model.spec import Network


@dataclass
class AlicloudNetworkArgs:
    network: Network
    tags: dict[str, str]
    peer_cidrs: list[str] = field(default_factory=list)
    pod_switches: bool = False  # an ACK cluster lives here: Terway's pod vSwitches, one per zone
    store_cidr: str = ""  # the rendezvous stores' own vSwitch (infra/rendezvous.py own_subnet); "" for none
    vm_nodes: bool = False  # it holds VM groups: their nodes get the VM group, never the cluster's


def pod_switch_cidr(net: Network, index: int) -> str:
    """A /20 for Terway's pods in the index-th zone (infra/clouds/alicloud/profile.py pod_switch_cidrs)."""
    return str(pod_switch_cidrs(net.cidr, [s.cidr for s in net.subnets])[index])


class AlicloudNetwork(pulumi.ComponentResource):
    vpc: alicloud.vpc.Network
    switches: list[alicloud.vpc.Switch]
    pod_switches: list[alicloud.vpc.Switch]  # Terway's (empty without an ACK cluster)
    store_switch: alicloud.vpc.Switch | None  # the rendezvous stores' alone (None without stores)
    security_group: alicloud.ecs.SecurityGroup | None  # the ACK cluster's (None without one)
    vm_security_group: alicloud.ecs.SecurityGroup | None  # the VM nodes' (None without VM groups)

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
        self.pod_switches = [
            alicloud.vpc.Switch(f"{name}-{sub.zone}-pods", vswitch_name=f"{name}-{sub.zone}-pods", vpc_id=self.vpc.id,
                                zone_id=sub.zone, cidr_block=pod_switch_cidr(net, i), tags=tags, opts=child)
            for i, sub in enumerate(net.subnets)] if args.pod_switches else []
        # The stores' fixed addresses live in a vSwitch nothing else names (no fleet, pool, pod
        # vSwitch, mount target or NAT): a vSwitch CIDR reservation holds ENI prefixes only, not
        # an instance's primary address, so a node could otherwise take a store's address while
        # the store is being replaced.
        self.store_switch = alicloud.vpc.Switch(
            f"{name}-stores", vswitch_name=f"{name}-stores", vpc_id=self.vpc.id, zone_id=net.subnets[0].zone,
            cidr_block=args.store_cidr, tags=tags, opts=child) if args.store_cidr else None
        if net.nat:
            self._nat(name, net, tags, child)

        # ACK's nodes and (with Terway) its pods' ENIs carry the cluster's group; VM nodes never do.
        self.security_group = self._cluster_group(name, args, tags, child) if args.pod_switches else None
        self.vm_security_group = self._vm_group(name, args, tags, child) if args.vm_nodes else None
        groups = {k: g.id for k, g in (("securityGroupId", self.security_group),
                                        ("vmSecurityGroupId", self.vm_security_group)) if g is not None}
        self.register_outputs({"vpcId": self.vpc.id, **groups})

    def _cluster_group(self, name: str, args: AlicloudNetworkArgs, tags: dict[str, str],
                       child: pulumi.ResourceOptions) -> alicloud.ecs.SecurityGroup:
        """The ACK cluster's group: all traffic among members, SSH from the listed CIDRs, the
        exporters from the monitoring source, every other port from peered VPCs (pods are fenced
        by NetworkPolicies, infra/k8s/netpol.py)."""
        net = args.network
        group = alicloud.ecs.SecurityGroup(
            f"{name}-training-sg", vpc_id=self.vpc.id, security_group_name=f"{name}-training",
            security_group_type="normal",
            description="GPU training nodes: all traffic among members (NCCL), SSH only from listed CIDRs",
            tags=tags, opts=child)
        sg = pulumi.ResourceOptions(parent=group)
        alicloud.ecs.SecurityGroupRule(f"{name}-training-self", type="ingress", ip_protocol="all",
                                       port_range="-1/-1", security_group_id=group.id,
                                       source_security_group_id=group.id, policy="accept",
                                       description="NCCL / rendezvous among training nodes", opts=sg)
        self._ssh_and_scrape(name, group, net, sg)
        # The exporters' ports (infra/model/scrape.py) from the monitoring source alone; peered VPCs get
        # every other port.
        for i, peer in enumerate(args.peer_cidrs):
            peer_rules = [("tcp", f"{lo}/{hi}") for lo, hi in scrape.other_tcp_ranges()] + [("udp", "1/65535"),
                                                                                            ("icmp", "-1/-1")]
            for proto, ports in peer_rules:
                suffix = f"{proto}-{ports.split('/')[0]}" if proto == "tcp" else proto
                alicloud.ecs.SecurityGroupRule(f"{name}-peer-{i}-{suffix}", type="ingress", ip_protocol=proto,
                                               port_range=ports, security_group_id=group.id, cidr_ip=peer,
                                               policy="accept",
                                               description="traffic from a peered VPC (not the exporters' ports)",
                                               opts=sg)
        self._egress(name, group, sg)
        return group

    def _vm_group(self, name: str, args: AlicloudNetworkArgs, tags: dict[str, str],
                  child: pulumi.ResourceOptions) -> alicloud.ecs.SecurityGroup:
        """The VM nodes' group: SSH from the listed CIDRs and the exporters from the monitoring
        source, nothing else. A basic ("normal") group lets its own members talk on every port
        unless its internal access policy is Drop (ECS "Basic security groups and advanced
        security groups"; pulumi_alicloud ecs/security_group.py inner_access_policy Accept |
        Drop): Drop here, so the nodes of one run reach each other through their run's group
        alone (run_group), and no other run, team, peered VPC or ACK pod reaches a node's
        collective or worker-store ports."""
        group = alicloud.ecs.SecurityGroup(
            f"{name}-vm-sg", vpc_id=self.vpc.id, security_group_name=f"{name}-vm", security_group_type="normal",
            inner_access_policy="Drop",
            description="GPU VM nodes: SSH from listed CIDRs, metrics from the monitoring source, nothing else",
            tags=tags, opts=child)
        sg = pulumi.ResourceOptions(parent=group)
        self._ssh_and_scrape(f"{name}-vm", group, args.network, sg)
        self._egress(f"{name}-vm", group, sg)
        return group

    def run_group(self, group: str, fabric: bool, tags: dict[str, str]) -> pulumi.Output[str]:
        """A multi-node VM group's own security group: all traffic among its nodes (the
        collectives, eRDMA, torch's worker store), by reference to itself, from nothing else."""
        del fabric  # eRDMA traffic follows the same rule (Alibaba "Configure eRDMA": the group's rules)
        run = alicloud.ecs.SecurityGroup(
            f"{group}-run-sg", vpc_id=self.vpc.id, security_group_name=f"{group}-run", security_group_type="normal",
            inner_access_policy="Accept",
            description=scrape.run_group_description(group),
            tags=tags, opts=pulumi.ResourceOptions(parent=self))
        alicloud.ecs.SecurityGroupRule(f"{group}-run-self", type="ingress", ip_protocol="all", port_range="-1/-1",
                                       security_group_id=run.id, source_security_group_id=run.id, policy="accept",
                                       description=f"collectives among the nodes of {group}",
                                       opts=pulumi.ResourceOptions(parent=run))
        return run.id

    @staticmethod
    def _ssh_and_scrape(prefix: str, group: alicloud.ecs.SecurityGroup, net: Network,
                        sg: pulumi.ResourceOptions) -> None:
        for i, cidr in enumerate(net.ssh_cidrs):
            alicloud.ecs.SecurityGroupRule(f"{prefix}-ssh-{i}", type="ingress", ip_protocol="tcp", port_range="22/22",
                                           security_group_id=group.id, cidr_ip=str(cidr),
                                           policy="accept", description="SSH from an allowed CIDR", opts=sg)
        for i, source in enumerate(scrape.sources(net)):
            for port in scrape.EXPORTER_PORTS:
                alicloud.ecs.SecurityGroupRule(f"{prefix}-scrape-{i}-{port}", type="ingress", ip_protocol="tcp",
                                               port_range=f"{port}/{port}", security_group_id=group.id,
                                               cidr_ip=source, policy="accept",
                                               description="metrics from the monitoring source", opts=sg)

    @staticmethod
    def _egress(prefix: str, group: alicloud.ecs.SecurityGroup, sg: pulumi.ResourceOptions) -> None:
        alicloud.ecs.SecurityGroupRule(f"{prefix}-egress", type="egress", ip_protocol="all", port_range="-1/-1",
                                       security_group_id=group.id, cidr_ip="0.0.0.0/0",
                                       policy="accept", description="egress", opts=sg)

    def _nat(self, name: str, net: Network, tags: dict[str, str], child: pulumi.ResourceOptions) -> None:
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
        pod_subnets = [sub.model_copy(update={"zone": f"{sub.zone}-pods"}) for sub in net.subnets]
        snat = [(sub.zone, switch) for sub, switch in zip([*net.subnets, *pod_subnets[:len(self.pod_switches)]],
                                                           [*self.switches, *self.pod_switches])]
        if self.store_switch is not None:  # the stores pull the trainer image
            snat.append(("stores", self.store_switch))
        for suffix, switch in snat:
            alicloud.vpc.SnatEntry(f"{name}-snat-{suffix}", snat_table_id=nat.snat_table_ids,
                                   source_vswitch_id=switch.id, snat_ip=eip.ip_address,
                                   opts=pulumi.ResourceOptions(parent=self, depends_on=[bind]))
