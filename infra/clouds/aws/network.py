"""AWS network: VPC, private subnets, NAT egress, S3 gateway endpoint, training security group."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.model import scrape
from infra.model.spec import Network


def public_cidr(net: Network, index: int) -> str:
    """A /24 for a NAT's public subnet: the highest free /24s of the VPC, clear of the private ones."""
    taken = [s.cidr for s in net.subnets]
    free = [c for c in reversed(list(net.cidr.subnets(new_prefix=24)))
            if not any(c.overlaps(t) for t in taken)]
    return str(free[index])


@dataclass
class AwsNetworkArgs:
    network: Network
    region: str
    tags: dict[str, str]
    peer_cidrs: list[str] = field(default_factory=list)  # peered VPCs, allowed into the cluster's group
    fabric: bool = False  # a cluster group in it uses EFA: the cluster's rule to itself goes both ways
    store_range: str = ""  # its rendezvous stores' range of the first subnet (infra/rendezvous.py store_range)
    cluster: bool = True  # it holds an EKS cluster: the cluster's nodes get the training group
    vm_nodes: bool = False  # it holds VM groups: their nodes get the VM group (infra/model/scrape.py)


class AwsNetwork(pulumi.ComponentResource):
    vpc: aws.ec2.Vpc
    private_subnets: list[aws.ec2.Subnet]
    private_route_tables: list[aws.ec2.RouteTable]
    security_group: aws.ec2.SecurityGroup | None  # the EKS nodes' (None without a cluster)
    vm_security_group: aws.ec2.SecurityGroup | None  # the VM nodes' (None without VM groups)
    store_reservation: aws.ec2.SubnetCidrReservation | None  # the rendezvous stores' range, when it has stores

    def __init__(self, name: str, args: AwsNetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Network", name, None, opts)
        net, tags = args.network, args.tags
        child = pulumi.ResourceOptions(parent=self)

        self.vpc = aws.ec2.Vpc(f"{name}-vpc", cidr_block=str(net.cidr), enable_dns_hostnames=True,
                               enable_dns_support=True, tags={**tags, "Name": f"{name}-vpc"}, opts=child)

        self.private_subnets = []
        self.private_route_tables = []
        for i, sub in enumerate(net.subnets):
            subnet = aws.ec2.Subnet(f"{name}-private-{sub.zone}", vpc_id=self.vpc.id, cidr_block=str(sub.cidr),
                                    availability_zone=sub.zone, map_public_ip_on_launch=False,
                                    tags={**tags, "Name": f"{name}-private-{sub.zone}", "tier": "private"},
                                    opts=child)
            table = aws.ec2.RouteTable(f"{name}-private-{sub.zone}-rt", vpc_id=self.vpc.id,
                                       tags={**tags, "Name": f"{name}-private-{sub.zone}"}, opts=child)
            aws.ec2.RouteTableAssociation(f"{name}-private-{sub.zone}-rta", subnet_id=subnet.id,
                                          route_table_id=table.id, opts=child)
            self.private_subnets.append(subnet)
            self.private_route_tables.append(table)

        if net.nat:
            self._nat(name, net, tags, child)

        # Dataset and checkpoint traffic to S3 stays on the gateway endpoint: free, and no NAT
        # data-processing charge per GB.
        aws.ec2.VpcEndpoint(f"{name}-s3", vpc_id=self.vpc.id, service_name=f"com.amazonaws.{args.region}.s3",
                            vpc_endpoint_type="Gateway",
                            route_table_ids=[t.id for t in self.private_route_tables],
                            tags={**tags, "Name": f"{name}-s3"}, opts=child)

        self.security_group = self._security_group(name, args, tags, child) if args.cluster else None
        self.vm_security_group = self._vm_group(name, args, tags, child) if args.vm_nodes else None
        # The stores' fixed addresses: "explicit" means EC2 hands out no address of the range on
        # its own (nodes, pods, mount targets); an instance gets one only by naming it (VPC user
        # guide, "Subnet CIDR reservations"). Held by the network, as Alibaba's and Tencent's
        # networks hold their stores' own vSwitch / subnet, and awaited by every store.
        self.store_reservation = aws.ec2.SubnetCidrReservation(
            f"{name}-stores", subnet_id=self.private_subnets[0].id, cidr_block=args.store_range,
            reservation_type="explicit", description="rendezvous stores' fixed addresses",
            opts=child) if args.store_range else None

        groups = {k: g.id for k, g in (("securityGroupId", self.security_group),
                                        ("vmSecurityGroupId", self.vm_security_group)) if g is not None}
        self.register_outputs({"vpcId": self.vpc.id, **groups, "privateSubnetIds": [s.id for s in self.private_subnets]})

    def _vm_group(self, name: str, args: AwsNetworkArgs, tags: dict[str, str],
                  child: pulumi.ResourceOptions) -> aws.ec2.SecurityGroup:
        """The VM nodes' group: SSH from the listed CIDRs and the exporters from the monitoring
        source, nothing else. Not even its own members: the nodes of one run reach each other
        through their run's group alone (run_group), so no other run, team, peered network or
        pod reaches a node's collective or worker-store ports (infra/model/scrape.py)."""
        group = aws.ec2.SecurityGroup(
            f"{name}-vm-sg", vpc_id=self.vpc.id,
            description="GPU VM nodes: SSH from listed CIDRs, metrics from the monitoring source, nothing else",
            tags={**tags, "Name": f"{name}-vm-sg"}, opts=child)
        opts = pulumi.ResourceOptions(parent=group)
        self._ssh_and_scrape(f"{name}-vm", group, args.network, tags, opts)
        self._egress(f"{name}-vm", group, tags, opts)
        return group

    def run_group(self, group: str, fabric: bool, tags: dict[str, str]) -> pulumi.Output[str]:
        """A multi-node VM group's own security group: all traffic among its nodes (the
        collectives, torch's worker store), by reference to itself, from nothing else; with EFA
        both ways (the EFA docs ask for all traffic to and from the group itself)."""
        run = aws.ec2.SecurityGroup(
            f"{group}-run-sg", vpc_id=self.vpc.id,
            description=scrape.run_group_description(group),
            tags={**tags, "Name": f"{group}-run-sg"}, opts=pulumi.ResourceOptions(parent=self))
        opts = pulumi.ResourceOptions(parent=run)
        aws.vpc.SecurityGroupIngressRule(f"{group}-run-self", security_group_id=run.id, referenced_security_group_id=run.id,
                                         ip_protocol="-1", description=f"collectives among the nodes of {group}",
                                         tags=tags, opts=opts)
        if fabric:
            aws.vpc.SecurityGroupEgressRule(f"{group}-run-self-egress", security_group_id=run.id,
                                            referenced_security_group_id=run.id, ip_protocol="-1",
                                            description=f"EFA to the other nodes of {group}", tags=tags, opts=opts)
        return run.id

    def _ssh_and_scrape(self, prefix: str, group: aws.ec2.SecurityGroup, net: Network, tags: dict[str, str],
                        sg_child: pulumi.ResourceOptions) -> None:
        """SSH from the listed CIDRs, the exporters from the monitoring source."""
        for i, cidr in enumerate(net.ssh_cidrs):
            aws.vpc.SecurityGroupIngressRule(f"{prefix}-ssh-{i}", security_group_id=group.id,
                                             cidr_ipv4=str(cidr), ip_protocol="tcp", from_port=22, to_port=22,
                                             description="SSH from an allowed CIDR", tags=tags, opts=sg_child)
        for i, source in enumerate(scrape.sources(net)):
            for port in scrape.EXPORTER_PORTS:
                aws.vpc.SecurityGroupIngressRule(f"{prefix}-scrape-{i}-{port}", security_group_id=group.id,
                                                 cidr_ipv4=source, ip_protocol="tcp", from_port=port, to_port=port,
                                                 description="metrics from the monitoring source", tags=tags,
                                                 opts=sg_child)

    def _egress(self, prefix: str, group: aws.ec2.SecurityGroup, tags: dict[str, str],
                sg_child: pulumi.ResourceOptions) -> None:
        aws.vpc.SecurityGroupEgressRule(f"{prefix}-egress", security_group_id=group.id,
                                        cidr_ipv4="0.0.0.0/0", ip_protocol="-1",
                                        description="egress (registries, buckets, peers)", tags=tags, opts=sg_child)

    def _security_group(self, name: str, args: AwsNetworkArgs, tags: dict[str, str],
                        child: pulumi.ResourceOptions) -> aws.ec2.SecurityGroup:
        """The EKS nodes' group: all traffic among members, SSH from the listed CIDRs, the
        exporters from the monitoring source, everything else from peers, the fabric's self egress.
        VM nodes never carry it (_vm_group)."""
        net = args.network
        group = aws.ec2.SecurityGroup(
            f"{name}-training-sg", vpc_id=self.vpc.id,
            description="GPU training nodes: all traffic among members (NCCL), SSH only from listed CIDRs",
            tags={**tags, "Name": f"{name}-training-sg"}, opts=child)
        sg_child = pulumi.ResourceOptions(parent=group)
        aws.vpc.SecurityGroupIngressRule(f"{name}-training-self", security_group_id=group.id,
                                         referenced_security_group_id=group.id, ip_protocol="-1",
                                         description="NCCL / rendezvous among training nodes", tags=tags,
                                         opts=sg_child)
        # EFA: all traffic to and from the group itself, in
        # both directions (AWS PCS working-with_networking_efa_create-sg; terraform-aws-eks
        # all_self_efa; dstack): the docs ask for it as well as any CIDR egress.
        if args.fabric:
            aws.vpc.SecurityGroupEgressRule(f"{name}-training-self-egress", security_group_id=group.id,
                                            referenced_security_group_id=group.id,
                                            ip_protocol="-1", description="EFA / NCCL to the other training nodes",
                                            tags=tags, opts=sg_child)
        self._ssh_and_scrape(name, group, net, tags, sg_child)
        # The exporters' ports (infra/model/scrape.py) from the monitoring source alone; peered VPCs get
        # every other port of the cluster's nodes (security groups only allow: "all but these
        # ports" is ranges). Pods are fenced by NetworkPolicies (infra/k8s/netpol.py).
        for i, peer_cidr in enumerate(args.peer_cidrs):
            peer_rules = [("tcp", lo, hi) for lo, hi in scrape.other_tcp_ranges()] + [("udp", 0, 65535), ("icmp", -1, -1)]
            for proto, lo, hi in peer_rules:
                suffix = f"{proto}-{lo}" if proto == "tcp" else proto
                aws.vpc.SecurityGroupIngressRule(f"{name}-peer-{i}-{suffix}", security_group_id=group.id,
                                                 cidr_ipv4=peer_cidr, ip_protocol=proto, from_port=lo, to_port=hi,
                                                 description="traffic from a peered VPC (not the exporters' ports)",
                                                 tags=tags, opts=sg_child)
        self._egress(name, group, tags, sg_child)
        return group

    def _nat(self, name: str, net: Network, tags: dict[str, str], child: pulumi.ResourceOptions) -> None:
        """One NAT gateway in the first zone: GPU nodes only pull images and packages through it,
        so one per zone would cost more than the outage risk is worth."""
        zone = net.subnets[0].zone
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=self.vpc.id, tags={**tags, "Name": f"{name}-igw"},
                                      opts=child)
        public = aws.ec2.Subnet(f"{name}-public-{zone}", vpc_id=self.vpc.id, cidr_block=public_cidr(net, 0),
                                availability_zone=zone, map_public_ip_on_launch=False,
                                tags={**tags, "Name": f"{name}-public-{zone}", "tier": "public"}, opts=child)
        public_rt = aws.ec2.RouteTable(f"{name}-public-rt", vpc_id=self.vpc.id,
                                       tags={**tags, "Name": f"{name}-public"}, opts=child)
        aws.ec2.Route(f"{name}-public-default", route_table_id=public_rt.id, destination_cidr_block="0.0.0.0/0",
                      gateway_id=igw.id, opts=child)
        aws.ec2.RouteTableAssociation(f"{name}-public-rta", subnet_id=public.id, route_table_id=public_rt.id,
                                      opts=child)
        eip = aws.ec2.Eip(f"{name}-nat-eip", domain="vpc", tags={**tags, "Name": f"{name}-nat"}, opts=child)
        nat = aws.ec2.NatGateway(f"{name}-nat", allocation_id=eip.id, subnet_id=public.id,
                                 tags={**tags, "Name": f"{name}-nat"},
                                 opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]))
        for sub, table in zip(net.subnets, self.private_route_tables):
            aws.ec2.Route(f"{name}-private-{sub.zone}-default", route_table_id=table.id,
                          destination_cidr_block="0.0.0.0/0", nat_gateway_id=nat.id, opts=child)


