"""AWS VPC peering with routes in every private route table on both sides."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.clouds.aws.network import AwsNetwork
from infra.model.spec import Network


@dataclass
class AwsPeeringArgs:
    requester: Network
    accepter: Network
    requester_net: AwsNetwork
    accepter_net: AwsNetwork
    requester_region: str
    accepter_region: str
    requester_provider: pulumi.ProviderResource
    accepter_provider: pulumi.ProviderResource
    tags: dict[str, str]


class AwsPeering(pulumi.ComponentResource):
    connection: aws.ec2.VpcPeeringConnection

    def __init__(self, name: str, args: AwsPeeringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Peering", name, None, opts)
        cross_region = args.requester_region != args.accepter_region
        req_opts = pulumi.ResourceOptions(parent=self, provider=args.requester_provider)
        acc_opts = pulumi.ResourceOptions(parent=self, provider=args.accepter_provider)

        # Same-region peers in one account accept at creation; cross-region ones need an
        # accepter in the peer's region.
        self.connection = aws.ec2.VpcPeeringConnection(
            f"{name}-pcx", vpc_id=args.requester_net.vpc.id, peer_vpc_id=args.accepter_net.vpc.id,
            peer_region=args.accepter_region if cross_region else None,
            auto_accept=None if cross_region else True,
            tags={**args.tags, "Name": name}, opts=req_opts)
        ready: list[pulumi.Resource] = [self.connection]
        if cross_region:
            accepter = aws.ec2.VpcPeeringConnectionAccepter(
                f"{name}-accepter", vpc_peering_connection_id=self.connection.id, auto_accept=True,
                tags={**args.tags, "Name": name}, opts=acc_opts)
            ready = [accepter]

        # Private DNS names of the peer resolve to private addresses on both sides. Each side's
        # options are set in that side's region.
        dns = aws.ec2.PeeringConnectionOptionsRequesterArgs(allow_remote_vpc_dns_resolution=True)
        if cross_region:
            aws.ec2.PeeringConnectionOptions(
                f"{name}-dns-requester", vpc_peering_connection_id=self.connection.id, requester=dns,
                opts=pulumi.ResourceOptions.merge(req_opts, pulumi.ResourceOptions(depends_on=ready)))
            aws.ec2.PeeringConnectionOptions(
                f"{name}-dns-accepter", vpc_peering_connection_id=self.connection.id,
                accepter=aws.ec2.PeeringConnectionOptionsAccepterArgs(allow_remote_vpc_dns_resolution=True),
                opts=pulumi.ResourceOptions.merge(acc_opts, pulumi.ResourceOptions(depends_on=ready)))
        else:
            aws.ec2.PeeringConnectionOptions(
                f"{name}-dns", vpc_peering_connection_id=self.connection.id, requester=dns,
                accepter=aws.ec2.PeeringConnectionOptionsAccepterArgs(allow_remote_vpc_dns_resolution=True),
                opts=pulumi.ResourceOptions.merge(req_opts, pulumi.ResourceOptions(depends_on=ready)))

        sides = ((args.requester_net, args.accepter.cidr, req_opts, "requester"),
                 (args.accepter_net, args.requester.cidr, acc_opts, "accepter"))
        for net, peer_cidr, side_opts, side in sides:
            for i, table in enumerate(net.private_route_tables):
                aws.ec2.Route(f"{name}-{side}-route-{i}", route_table_id=table.id,
                              destination_cidr_block=str(peer_cidr),
                              vpc_peering_connection_id=self.connection.id,
                              opts=pulumi.ResourceOptions.merge(side_opts, pulumi.ResourceOptions(depends_on=ready)))
        self.register_outputs({"peeringConnectionId": self.connection.id})
