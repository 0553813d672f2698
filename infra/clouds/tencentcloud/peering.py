"""Tencent Cloud VPC links: peering connections (same- and cross-region) with PEERCONNECTION
routes on both sides, or a Cloud Connect Network for links marked `via: transit`."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.clouds.tencentcloud.network import TencentNetwork
from infra.model.spec import Network, Peering

DEFAULT_CROSS_REGION_MBPS = 1000


@dataclass
class TencentPeeringArgs:
    peering: Peering
    requester: Network
    accepter: Network
    requester_net: TencentNetwork
    accepter_net: TencentNetwork
    requester_region: str
    accepter_region: str
    owner_uin: pulumi.Output[str]
    requester_provider: pulumi.ProviderResource
    accepter_provider: pulumi.ProviderResource


class TencentPeering(pulumi.ComponentResource):
    connection: tencentcloud.vpc.PeerConnectManager

    def __init__(self, name: str, args: TencentPeeringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Peering", name, None, opts)
        cross = args.requester_region != args.accepter_region
        req = pulumi.ResourceOptions(parent=self, provider=args.requester_provider)
        acc = pulumi.ResourceOptions(parent=self, provider=args.accepter_provider)
        # Both VPCs are in this account (destination UIN = owner): no separate accept step.
        self.connection = tencentcloud.vpc.PeerConnectManager(
            f"{name}-pcx", peering_connection_name=name, source_vpc_id=args.requester_net.vpc.id,
            destination_vpc_id=args.accepter_net.vpc.id, destination_region=args.accepter_region,
            destination_uin=args.owner_uin,
            bandwidth=(args.peering.bandwidth_mbps or DEFAULT_CROSS_REGION_MBPS) if cross else None, opts=req)
        for net, peer_cidr, side_opts, side in ((args.requester_net, args.accepter.cidr, req, "requester"),
                                                (args.accepter_net, args.requester.cidr, acc, "accepter")):
            tencentcloud.route.TableEntry(f"{name}-{side}-route", route_table_id=net.route_table.id,
                                          destination_cidr_block=str(peer_cidr), next_type="PEERCONNECTION",
                                          next_hub=self.connection.id, description=f"peering {name}", opts=side_opts)
        self.register_outputs({"peeringConnectionId": self.connection.id})


@dataclass
class TencentTransitArgs:
    networks: list[tuple[str, TencentNetwork, str]]  # (name, network, region)
    tags: dict[str, str]


class TencentTransit(pulumi.ComponentResource):
    """One CCN for all of a stack's `via: transit` links; CCN learns and spreads the routes."""

    def __init__(self, name: str, args: TencentTransitArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Transit", name, None, opts)
        self.ccn = tencentcloud.ccn.Instance(f"{name}-ccn", name=name, qos="AU", charge_type="POSTPAID",
                                             bandwidth_limit_type="INTER_REGION_LIMIT", tags=args.tags,
                                             opts=pulumi.ResourceOptions(parent=self))
        for net_name, net, region in args.networks:
            tencentcloud.ccn.AttachmentV2(f"{name}-{net_name}", ccn_id=self.ccn.id, instance_id=net.vpc.id,
                                          instance_region=region, instance_type="VPC",
                                          opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"ccnId": self.ccn.id})
