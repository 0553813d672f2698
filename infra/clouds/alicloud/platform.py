"""The Alibaba Cloud side of a stack: networks, peerings, OSS, RAM, ESS/ECS fleets, ACK, alerts."""

from __future__ import annotations

from collections.abc import Mapping

import pulumi
import pulumi_alicloud as alicloud

from infra.buckets import bucket
from infra.clouds.alicloud import secrets
from infra.clouds.alicloud.access import AlicloudAccess, AlicloudAccessArgs
from infra.clouds.alicloud.budget import AlicloudBudget, AlicloudBudgetArgs
from infra.clouds.alicloud.fleet import AlicloudGpuFleet, AlicloudGpuFleetArgs
from infra.clouds.alicloud.health import grant_replace_self
from infra.clouds.alicloud.kubernetes import AlicloudAck, AlicloudAckArgs
from infra.clouds.alicloud.network import AlicloudNetwork, AlicloudNetworkArgs
from infra.clouds.alicloud.peering import AlicloudPeering, AlicloudPeeringArgs
from infra.clouds.alicloud.registry import AlicloudRegistry, AlicloudRegistryArgs
from infra.clouds.alicloud.rendezvous import AlicloudRendezvous, AlicloudRendezvousArgs
from infra.clouds.alicloud.sharedfs import AlicloudSharedFs, AlicloudSharedFsArgs
from infra.clouds.alicloud.storage import AlicloudStorage, AlicloudStorageArgs
from infra.clouds.base import CloudPlatform, Cluster
from infra.image import Registry
from infra.model.spec import Network
from infra.render import bundle
from infra.rendezvous import Site
from infra.resolve.groups import ResolvedGroup
from infra.resolve.sharedfs import SharedFsOutputs


class AlicloudPlatform(CloudPlatform[AlicloudNetwork, AlicloudStorage, AlicloudAccess]):
    CLOUD = "alicloud"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        return alicloud.Provider(f"{self.name}-{region}", region=region,
                                 opts=pulumi.ResourceOptions(parent=self))

    def make_network(self, net: Network) -> AlicloudNetwork:
        stores = next((s.subnet for s in self.rendezvous_sites() if s.network == net.name), "")
        return AlicloudNetwork(net.name, AlicloudNetworkArgs(net, self.tags, self.peer_cidrs()[net.name],
                                                             pod_switches=net.name in self.kubernetes_groups(),
                                                             store_cidr=stores,
                                                             vm_nodes=net.name in self.vm_networks()),
                               opts=self.provider_opts(self.region_of(net)))

    def vpc_id(self, net: AlicloudNetwork) -> pulumi.Output[str]:
        return net.vpc.id

    def make_links(self, nets: dict[str, AlicloudNetwork]) -> None:
        for p in self.peerings():
            req, acc = self.spec.network(p.requester), self.spec.network(p.accepter)
            AlicloudPeering(p.name, AlicloudPeeringArgs(
                peering=p, requester=req, accepter=acc, requester_net=nets[req.name], accepter_net=nets[acc.name],
                requester_region=self.region_of(req), accepter_region=self.region_of(acc),
                requester_provider=self.provider(self.region_of(req)),
                accepter_provider=self.provider(self.region_of(acc)), tags=self.tags),
                opts=pulumi.ResourceOptions(parent=self))

    def make_storage(self) -> AlicloudStorage:
        return AlicloudStorage(f"{self.name}-storage",
                               AlicloudStorageArgs(self.spec.storage, bucket(self.spec, self.CLOUD), bundle.build(), self.tags),
                               opts=self.provider_opts())

    def make_shared_fs(self, net: Network, built: AlicloudNetwork, storage: AlicloudStorage) -> SharedFsOutputs:
        shared = AlicloudSharedFs(f"{net.name}", AlicloudSharedFsArgs(
            env=self.spec.env, network=net, vswitch_id=built.switches[0].id, zone=net.subnets[0].zone,
            allowed_cidrs=[str(net.cidr), *self.peer_cidrs()[net.name]], tags=self.tags),
            opts=self.provider_opts(self.region_of(net)))
        return shared.outputs

    def bucket_name(self, storage: AlicloudStorage) -> pulumi.Output[str]:
        return storage.bucket.bucket

    def make_access(self, storage: AlicloudStorage) -> AlicloudAccess:
        return AlicloudAccess(f"{self.name}-access", AlicloudAccessArgs(
            storage.name, self.spec.env, self.tags, groups=self.access_grants(),
            kubernetes=bool(self.kubernetes_groups()),
            autoscaler_role=self.account.account_settings and bool(self.kubernetes_groups())), opts=self.provider_opts())

    def make_registry(self, nets: dict[str, AlicloudNetwork]) -> Registry:
        return AlicloudRegistry(f"{self.name}-registry", AlicloudRegistryArgs(
            self.spec.env, [str(c) for c in self.spec.kubernetes.api_access_cidrs],
            [(n.name, nets[n.name].vpc.id, nets[n.name].switches[0].id) for n in self.node_networks()], self.tags),
            opts=self.provider_opts()).registry

    def make_rendezvous(self, site: Site, net: AlicloudNetwork, access: AlicloudAccess,
                        image: pulumi.Output[str]) -> pulumi.Resource:
        stores = net.store_switch
        assert stores is not None, "make_network gives a network with stores their own vSwitch"
        store = AlicloudRendezvous(f"{self.spec.env}-{site.name}", AlicloudRendezvousArgs(
            site=site, instance_type=self.store_instance_type(), vpc_id=net.vpc.id, vswitch_id=stores.id,
            role_name=access.roles[site.name].role_name,
            user_data=self.store_user_data(site, image), provider=self.provider(self.region_of(site.network)),
            tags=self.tags), opts=pulumi.ResourceOptions(parent=self))
        self.store_clients[site.group] = store.clients.id
        return store.instance

    def make_key_secret(self, group: ResolvedGroup, key: pulumi.Output[str], access: AlicloudAccess) -> str:
        # In the stack's default region, with its bucket: the node asks there (STORAGE_REGION).
        return secrets.rendezvous_key(self.spec.env, group.name, self.account.region, key, access.roles[group.name].role_name,
                                      self.tags, pulumi.ResourceOptions(parent=self, provider=self.provider()))

    def make_fleet(self, group: ResolvedGroup, net: AlicloudNetwork, access: AlicloudAccess,
                   image: pulumi.Output[str]) -> pulumi.Output[list[str]]:
        switches, zones = self.fleet_subnets(group, net.switches)  # a zone candidate: that zone's only
        assert net.vm_security_group is not None  # made for every network with VM groups
        runs = [net.run_group(group.name, group.fabric is not None, self.tags)] if self.spans_nodes(group) else []
        fleet = AlicloudGpuFleet(group.name, AlicloudGpuFleetArgs(
            group=group, vpc_id=net.vpc.id, switch_ids=[s.id for s in switches],
            zones=zones, security_group_id=net.vm_security_group.id,
            role_name=access.roles[group.name].role_name, user_data=self.user_data(group, image),
            provider=self.provider(group.region), tags=self.tags, env=self.spec.env, after=self.after_store(group),
            store_clients=[*self.clients_of(group), *runs]),
            opts=pulumi.ResourceOptions(parent=self))
        if hasattr(fleet, "group"):  # a reserved group is fixed instances: no group to hand a node back to
            grant_replace_self(f"{self.spec.env}-{group.name}", access.roles[group.name].role_name, group.region, fleet.group, self.tags,
                               pulumi.ResourceOptions(parent=fleet, provider=self.provider(group.region),
                                                      depends_on=self.after_store(group)))
        return fleet.capacity

    def make_cluster(self, net: Network, groups: list[ResolvedGroup], built: AlicloudNetwork,
                     access: AlicloudAccess, storage: AlicloudStorage, images: Mapping[str, pulumi.Output[str]]) -> Cluster:
        assert access.ack_node_role is not None and built.security_group is not None
        ack = AlicloudAck(f"{self.spec.env}-{net.name}", AlicloudAckArgs(
            spec=self.spec, groups=groups, teams=self.stack.teams, switch_ids=[s.id for s in built.switches],
            pod_switch_ids=[s.id for s in built.pod_switches],
            security_group_id=built.security_group.id, role_name=access.ack_node_role.role_name,
            network_cidr=str(net.cidr), access=access, images=images, provider=self.provider(self.region_of(net)),
            tags=self.tags, shared=self.shared.get(net.name)), opts=pulumi.ResourceOptions(parent=self))
        return Cluster(ack.cluster.id, ack.kubeconfig)

    def make_budget(self) -> None:
        AlicloudBudget(f"{self.name}-budget", AlicloudBudgetArgs(self.spec.budget, self.spec.env),
                       opts=self.provider_opts())
