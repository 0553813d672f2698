"""The Alibaba Cloud side of a stack: networks, peerings, OSS, RAM, ESS/ECS fleets, ACK, alerts."""

from __future__ import annotations

import pulumi
import pulumi_alicloud as alicloud

from infra import userdata
from infra.clouds.alicloud.access import AlicloudAccess, AlicloudAccessArgs
from infra.clouds.alicloud.budget import AlicloudBudget, AlicloudBudgetArgs
from infra.clouds.alicloud.fleet import AlicloudGpuFleet, AlicloudGpuFleetArgs
from infra.clouds.alicloud.kubernetes import AlicloudAck, AlicloudAckArgs
from infra.clouds.alicloud.network import AlicloudNetwork, AlicloudNetworkArgs
from infra.clouds.alicloud.peering import AlicloudPeering, AlicloudPeeringArgs
from infra.clouds.alicloud.storage import AlicloudStorage, AlicloudStorageArgs, checkpoint_root
from infra.clouds import checkpoint_url as group_checkpoint_url
from infra.clouds.base import CHECKPOINT_PREFIX, DATASET_PREFIX, CloudPlatform


class AlicloudPlatform(CloudPlatform):
    CLOUD = "alicloud"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        return alicloud.Provider(f"{self.name}-{region}", region=region,
                                 opts=pulumi.ResourceOptions(parent=self))

    def build(self) -> None:
        spec, tags, region = self.spec, self.tags, self.account.region
        peer_cidrs = self.peer_cidrs()
        nets = {net.name: AlicloudNetwork(net.name, AlicloudNetworkArgs(net, tags, peer_cidrs[net.name]),
                                          opts=self.provider_opts(spec.region_of(net)))
                for net in self.networks()}
        for p in self.peerings():
            req, acc = spec.network(p.requester), spec.network(p.accepter)
            AlicloudPeering(p.name, AlicloudPeeringArgs(
                peering=p, requester=req, accepter=acc, requester_net=nets[req.name], accepter_net=nets[acc.name],
                requester_region=spec.region_of(req), accepter_region=spec.region_of(acc),
                requester_provider=self.providers[spec.region_of(req)],
                accepter_provider=self.providers[spec.region_of(acc)], tags=tags),
                opts=pulumi.ResourceOptions(parent=self))

        storage = AlicloudStorage(f"{self.name}-storage", AlicloudStorageArgs(spec.storage, region, tags),
                                  opts=self.provider_opts(region))
        checkpoint_url = checkpoint_root(spec)
        access = AlicloudAccess(f"{self.name}-access", AlicloudAccessArgs(
            storage.name, [CHECKPOINT_PREFIX, DATASET_PREFIX], tags), opts=self.provider_opts(region))

        fleets: dict[str, pulumi.Output[list[str]]] = {}
        for g in self.vm_groups():
            net = spec.network(g.network)
            ctx = userdata.node_context(spec, g, group_checkpoint_url(spec, g))
            fleet = AlicloudGpuFleet(g.name, AlicloudGpuFleetArgs(
                spec=spec, group=g, vpc_id=nets[net.name].vpc.id, switch_ids=[s.id for s in nets[net.name].switches],
                zones=[s.zone for s in net.subnets], security_group_id=nets[net.name].security_group.id,
                role_name=access.role.role_name, user_data=userdata.for_vm(ctx),
                provider=self.providers[spec.region_of(net)], tags=tags), opts=pulumi.ResourceOptions(parent=self))
            fleets[g.name] = fleet.capacity

        clusters: dict[str, pulumi.Output[str]] = {}
        kubeconfigs: dict[str, pulumi.Output[str]] = {}
        for net_name, kube_groups in self.kubernetes_groups().items():
            net = spec.network(net_name)
            ack = AlicloudAck(f"{spec.env}-{net.name}", AlicloudAckArgs(
                spec=spec, groups=kube_groups, switch_ids=[s.id for s in nets[net.name].switches],
                security_group_id=nets[net.name].security_group.id, role_name=access.role.role_name,
                checkpoint_url=checkpoint_url, provider=self.providers[spec.region_of(net)], tags=tags),
                opts=pulumi.ResourceOptions(parent=self))
            clusters[net.name] = ack.cluster.id
            kubeconfigs[net.name] = ack.kubeconfig

        AlicloudBudget(f"{self.name}-budget", AlicloudBudgetArgs(spec.budget, spec.env), opts=self.provider_opts(region))
        self.export({name: n.vpc.id for name, n in nets.items()}, storage.bucket.bucket, checkpoint_url,
                    fleets, clusters, kubeconfigs)
