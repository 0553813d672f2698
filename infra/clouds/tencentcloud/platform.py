"""The Tencent Cloud side of a stack: networks, peerings / CCN, COS, CAM, CVM/AS fleets, TKE, budget."""

from __future__ import annotations

from collections.abc import Mapping

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.buckets import bucket
from infra.checks.cloud_rules import POD_CIDR
from infra.clouds.base import CloudPlatform, Cluster
from infra.clouds.tencentcloud import secrets
from infra.clouds.tencentcloud.access import TencentAccess, TencentAccessArgs
from infra.clouds.tencentcloud.budget import TencentBudget, TencentBudgetArgs
from infra.clouds.tencentcloud.fleet import TencentGpuFleet, TencentGpuFleetArgs
from infra.clouds.tencentcloud.health import grant_replace_self, publish_group_id
from infra.clouds.tencentcloud.kubernetes import TencentTke, TencentTkeArgs
from infra.clouds.tencentcloud.network import TencentNetwork, TencentNetworkArgs
from infra.clouds.tencentcloud.peering import TencentPeering, TencentPeeringArgs, TencentTransit, TencentTransitArgs
from infra.clouds.tencentcloud.registry import TencentRegistry, TencentRegistryArgs
from infra.clouds.tencentcloud.rendezvous import TencentRendezvous, TencentRendezvousArgs
from infra.clouds.tencentcloud.sharedfs import TencentSharedFs, TencentSharedFsArgs
from infra.clouds.tencentcloud.storage import TencentStorage, TencentStorageArgs
from infra.image import Registry
from infra.model.spec import Network
from infra.render import bundle
from infra.rendezvous import Site
from infra.resolve.access import CLUSTER_NODE, node_grants
from infra.resolve.groups import ResolvedGroup
from infra.resolve.sharedfs import SharedFsOutputs


class TencentcloudPlatform(CloudPlatform[TencentNetwork, TencentStorage, TencentAccess]):
    CLOUD = "tencentcloud"

    @property
    def app_id(self) -> str:
        return self.account.app_id or ""  # the spec requires it for Tencent

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        return tencentcloud.Provider(f"{self.name}-{region}", region=region,
                                     opts=pulumi.ResourceOptions(parent=self))

    def make_network(self, net: Network) -> TencentNetwork:
        stores = next((s.subnet for s in self.rendezvous_sites() if s.network == net.name), "")
        pods = [str(POD_CIDR)] if net.name in self.kubernetes_groups() else []
        return TencentNetwork(net.name, TencentNetworkArgs(net, self.tags, self.peer_cidrs()[net.name], pods,
                                                           store_cidr=stores, cluster=net.name in self.kubernetes_groups(),
                                                           vm_nodes=net.name in self.vm_networks()),
                              opts=self.provider_opts(self.region_of(net)))

    def vpc_id(self, net: TencentNetwork) -> pulumi.Output[str]:
        return net.vpc.id

    def make_links(self, nets: dict[str, TencentNetwork]) -> None:
        owner = tencentcloud.user.get_info_output(
            opts=pulumi.InvokeOutputOptions(provider=self.provider(), parent=self)).owner_uin
        transit: dict[str, tuple[str, TencentNetwork, str]] = {}
        for p in self.peerings():
            req, acc = self.spec.network(p.requester), self.spec.network(p.accepter)
            if p.via == "transit":
                for n in (req, acc):
                    transit[n.name] = (n.name, nets[n.name], self.region_of(n))
                continue
            TencentPeering(p.name, TencentPeeringArgs(
                peering=p, requester=req, accepter=acc, requester_net=nets[req.name], accepter_net=nets[acc.name],
                requester_region=self.region_of(req), accepter_region=self.region_of(acc), owner_uin=owner,
                requester_provider=self.provider(self.region_of(req)),
                accepter_provider=self.provider(self.region_of(acc))), opts=pulumi.ResourceOptions(parent=self))
        if transit:
            TencentTransit(f"{self.name}-transit", TencentTransitArgs(list(transit.values()), self.tags),
                           opts=self.provider_opts())

    def make_storage(self) -> TencentStorage:
        self.storage = TencentStorage(f"{self.name}-storage",
                              TencentStorageArgs(self.spec.storage, bucket(self.spec, self.CLOUD), bundle.build(), self.tags),
                              opts=self.provider_opts())
        return self.storage

    def make_shared_fs(self, net: Network, built: TencentNetwork, storage: TencentStorage) -> SharedFsOutputs:
        shared = TencentSharedFs(f"{net.name}", TencentSharedFsArgs(
            network=net, vpc_id=built.vpc.id, subnet_id=built.subnets[0].id, zone=net.subnets[0].zone,
            allowed_cidrs=[str(net.cidr), *self.peer_cidrs()[net.name]], tags=self.tags),
            opts=self.provider_opts(self.region_of(net)))
        return shared.outputs

    def bucket_name(self, storage: TencentStorage) -> pulumi.Output[str]:
        return storage.bucket.bucket

    def make_access(self, storage: TencentStorage) -> TencentAccess:
        return TencentAccess(f"{self.name}-access", TencentAccessArgs(
            storage.name, self.account.region, self.app_id, self.spec.env, self.tags,
            groups={**{g.name: node_grants(self.spec, g) for g in self.node_groups()},
                    **{site.name: CLUSTER_NODE for site in self.rendezvous_sites()}}), opts=self.provider_opts())

    def make_registry(self, nets: dict[str, TencentNetwork]) -> Registry:
        return TencentRegistry(f"{self.name}-registry", TencentRegistryArgs(
            self.spec.env, [str(c) for c in self.spec.kubernetes.api_access_cidrs],
            [(n.name, nets[n.name].vpc.id, nets[n.name].subnets[0].id) for n in self.node_networks()], self.tags),
            opts=self.provider_opts()).registry

    def make_rendezvous(self, site: Site, net: TencentNetwork, access: TencentAccess,
                        image: pulumi.Output[str]) -> pulumi.Resource:
        stores = net.store_subnet
        assert stores is not None, "make_network gives a network with stores their own subnet"
        store = TencentRendezvous(f"{self.spec.env}-{site.name}", TencentRendezvousArgs(
            site=site, instance_type=self.store_instance_type(), vpc_id=net.vpc.id, subnet_id=stores.id,
            role_name=access.roles[site.name].name,
            user_data=self.store_user_data(site, image), provider=self.provider(self.region_of(site.network)),
            tags=self.tags), opts=pulumi.ResourceOptions(parent=self))
        self.store_clients[site.group] = store.clients.id
        return store.instance

    def make_key_secret(self, group: ResolvedGroup, key: pulumi.Output[str], access: TencentAccess) -> str:
        # In the stack's default region, with its bucket: the node asks there (STORAGE_REGION).
        return secrets.rendezvous_key(self.spec.env, group.name, self.account.region, key, access.roles[group.name].id,
                                      self.tags, pulumi.ResourceOptions(parent=self, provider=self.provider()))

    def make_fleet(self, group: ResolvedGroup, net: TencentNetwork, access: TencentAccess,
                   image: pulumi.Output[str]) -> pulumi.Output[list[str]]:
        subnets, zones = self.fleet_subnets(group, net.subnets)  # a zone candidate: that zone's only
        assert net.vm_security_group is not None  # made for every network with VM groups
        runs = [net.run_group(group.name, group.fabric is not None, self.tags)] if self.spans_nodes(group) else []
        fleet = TencentGpuFleet(group.name, TencentGpuFleetArgs(
            group=group, vpc_id=net.vpc.id, subnet_ids=[s.id for s in subnets],
            zones=zones, security_group_id=net.vm_security_group.id,
            role_name=access.roles[group.name].name, user_data=self.user_data(group, image),
            provider=self.provider(group.region), tags=self.tags, after=self.after_store(group),
            store_clients=[*self.clients_of(group), *runs], moved_to=self.moved_to(group)),
            opts=pulumi.ResourceOptions(parent=self))
        if hasattr(fleet, "group"):  # fixed instances only: no group to hand a node back to
            grant_replace_self(f"{self.spec.env}-{group.name}", access.roles[group.name].id, group.region, fleet.group,
                               pulumi.ResourceOptions(parent=fleet, provider=self.provider(group.region),
                                                      depends_on=self.after_store(group)))
            # The node learns its group's id from the bucket (no metadata entry names it).
            publish_group_id(f"{self.spec.env}-{group.name}", group.name, self.storage.bucket.bucket, fleet.group,
                             self.tags, pulumi.ResourceOptions(parent=fleet, provider=self.provider(),
                                                    depends_on=self.after_store(group)))
        return fleet.capacity

    def make_cluster(self, net: Network, groups: list[ResolvedGroup], built: TencentNetwork,
                     access: TencentAccess, storage: TencentStorage, images: Mapping[str, pulumi.Output[str]]) -> Cluster:
        assert built.security_group is not None  # made for every network with a cluster
        tke = TencentTke(f"{self.spec.env}-{net.name}", TencentTkeArgs(
            spec=self.spec, groups=groups, teams=self.stack.teams, vpc_id=built.vpc.id, subnet_ids=[s.id for s in built.subnets],
            security_group_id=built.security_group.id, role_names={g.name: access.roles[g.name].name for g in groups},
            images=images, provider=self.provider(self.region_of(net)), tags=self.tags, access=access,
            shared=self.shared.get(net.name)),
            opts=pulumi.ResourceOptions(parent=self))
        return Cluster(tke.cluster.id, tke.kubeconfig)

    def make_budget(self) -> None:
        TencentBudget(f"{self.name}-budget",
                      TencentBudgetArgs(self.spec.budget, self.spec.env, self.spec.pricing.cny_per_usd,
                                        self.account.account_settings),
                      opts=self.provider_opts())
