"""Alibaba Cloud VPC peering (same- and cross-region) with route entries on both sides."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.clouds.alicloud.network import AlicloudNetwork
from infra.model.spec import Network, Peering

DEFAULT_CROSS_REGION_MBPS = 1024


@dataclass
class AlicloudPeeringArgs:
    peering: Peering
    requester: Network
    accepter: Network
    requester_net: AlicloudNetwork
    accepter_net: AlicloudNetwork
    requester_region: str
    accepter_region: str
    requester_provider: pulumi.ProviderResource
    accepter_provider: pulumi.ProviderResource
    tags: dict[str, str]


class AlicloudPeering(pulumi.ComponentResource):
    connection: alicloud.vpc.PeerConnection

    def __init__(self, name: str, args: AlicloudPeeringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Peering", name, None, opts)
        cross = args.requester_region != args.accepter_region
        req = pulumi.ResourceOptions(parent=self, provider=args.requester_provider)
        acc = pulumi.ResourceOptions(parent=self, provider=args.accepter_provider)
        # Within one account the peer connection activates by itself; a PeerConnectionAccepter
        # is only needed across accounts, which stacks here do not do. Cross-region links are
        # billed by bandwidth, so it is always set there.
        self.connection = alicloud.vpc.PeerConnection(
            f"{name}-pcx", peer_connection_name=name, vpc_id=args.requester_net.vpc.id,
            accepting_vpc_id=args.accepter_net.vpc.id, accepting_region_id=args.accepter_region,
            bandwidth=(args.peering.bandwidth_mbps or DEFAULT_CROSS_REGION_MBPS) if cross else None,
            tags=args.tags, opts=req)
        for net, peer_cidr, side_opts, side in ((args.requester_net, args.accepter.cidr, req, "requester"),
                                                (args.accepter_net, args.requester.cidr, acc, "accepter")):
            alicloud.vpc.RouteEntry(f"{name}-{side}-route", route_table_id=net.vpc.route_table_id,
                                    destination_cidrblock=str(peer_cidr), nexthop_type="VpcPeer",
                                    nexthop_id=self.connection.id, opts=side_opts)
        self.register_outputs({"peerConnectionId": self.connection.id})
