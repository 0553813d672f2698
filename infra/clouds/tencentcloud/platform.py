"""The Tencent Cloud side of a stack: networks, peerings / CCN, COS, CAM, CVM/AS fleets, TKE, budget."""

from __future__ import annotations

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra import userdata
from infra.clouds import checkpoint_url as group_checkpoint_url
from infra.clouds.base import CHECKPOINT_PREFIX, DATASET_PREFIX, CloudPlatform
from infra.clouds.tencentcloud.access import TencentAccess, TencentAccessArgs
from infra.clouds.tencentcloud.budget import TencentBudget, TencentBudgetArgs
from infra.clouds.tencentcloud.fleet import TencentGpuFleet, TencentGpuFleetArgs
from infra.clouds.tencentcloud.kubernetes import TencentTke, TencentTkeArgs
from infra.clouds.tencentcloud.network import TencentNetwork, TencentNetworkArgs
from infra.clouds.tencentcloud.peering import TencentPeering, TencentPeeringArgs, TencentTransit, TencentTransitArgs
from infra.clouds.tencentcloud.storage import TencentStorage, TencentStorageArgs, checkpoint_root


class TencentcloudPlatform(CloudPlatform):
    CLOUD = "tencentcloud"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        return tencentcloud.Provider(f"{self.name}-{region}", region=region,
                                     opts=pulumi.ResourceOptions(parent=self))

    def build(self) -> None:
        spec, tags, region = self.spec, self.tags, self.account.region
        app_id = self.account.app_id or ""  # the spec requires it for Tencent
        peer_cidrs = self.peer_cidrs()
        nets = {net.name: TencentNetwork(net.name, TencentNetworkArgs(net, tags, peer_cidrs[net.name]),
                                         opts=self.provider_opts(spec.region_of(net)))
                for net in self.networks()}

        owner = tencentcloud.user.get_info_output(
            opts=pulumi.InvokeOutputOptions(provider=self.providers[region], parent=self)).owner_uin
        transit: dict[str, tuple[str, TencentNetwork, str]] = {}
        for p in self.peerings():
            req, acc = spec.network(p.requester), spec.network(p.accepter)
            if p.via == "transit":
                for n in (req, acc):
                    transit[n.name] = (n.name, nets[n.name], spec.region_of(n))
                continue
            TencentPeering(p.name, TencentPeeringArgs(
                peering=p, requester=req, accepter=acc, requester_net=nets[req.name], accepter_net=nets[acc.name],
                requester_region=spec.region_of(req), accepter_region=spec.region_of(acc), owner_uin=owner,
                requester_provider=self.providers[spec.region_of(req)],
                accepter_provider=self.providers[spec.region_of(acc)]), opts=pulumi.ResourceOptions(parent=self))
        if transit:
            TencentTransit(f"{self.name}-transit", TencentTransitArgs(list(transit.values()), tags),
                           opts=self.provider_opts(region))

        storage = TencentStorage(f"{self.name}-storage", TencentStorageArgs(spec.storage, region, app_id, tags),
                                 opts=self.provider_opts(region))
        checkpoint_url = checkpoint_root(spec)
        access = TencentAccess(f"{self.name}-access", TencentAccessArgs(
            storage.name, region, app_id, [CHECKPOINT_PREFIX, DATASET_PREFIX], tags), opts=self.provider_opts(region))

        fleets: dict[str, pulumi.Output[list[str]]] = {}
        for g in self.vm_groups():
            net = spec.network(g.network)
            ctx = userdata.node_context(spec, g, group_checkpoint_url(spec, g))
            fleet = TencentGpuFleet(g.name, TencentGpuFleetArgs(
                spec=spec, group=g, vpc_id=nets[net.name].vpc.id, subnet_ids=[s.id for s in nets[net.name].subnets],
                zones=[s.zone for s in net.subnets], security_group_id=nets[net.name].security_group.id,
                role_name=access.role.name, user_data=userdata.for_vm(ctx),
                provider=self.providers[spec.region_of(net)], tags=tags), opts=pulumi.ResourceOptions(parent=self))
            fleets[g.name] = fleet.capacity

        clusters: dict[str, pulumi.Output[str]] = {}
        kubeconfigs: dict[str, pulumi.Output[str]] = {}
        for net_name, kube_groups in self.kubernetes_groups().items():
            net = spec.network(net_name)
            tke = TencentTke(f"{spec.env}-{net.name}", TencentTkeArgs(
                spec=spec, groups=kube_groups, vpc_id=nets[net.name].vpc.id,
                subnet_ids=[s.id for s in nets[net.name].subnets], security_group_id=nets[net.name].security_group.id,
                role_name=access.role.name, checkpoint_url=checkpoint_url,
                provider=self.providers[spec.region_of(net)], tags=tags), opts=pulumi.ResourceOptions(parent=self))
            clusters[net.name] = tke.cluster.id
            kubeconfigs[net.name] = tke.kubeconfig

        TencentBudget(f"{self.name}-budget", TencentBudgetArgs(spec.budget, spec.env, spec.pricing.cny_per_usd),
                      opts=self.provider_opts(region))
        self.export({name: n.vpc.id for name, n in nets.items()}, storage.bucket.bucket, checkpoint_url,
                    fleets, clusters, kubeconfigs)
