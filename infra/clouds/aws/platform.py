"""The AWS side of a stack: networks, peerings, storage, access, the trainer image, GPU fleets,
EKS, budget."""

from __future__ import annotations

import re
from collections.abc import Mapping

import pulumi
import pulumi_aws as aws

from infra import rendezvous
from infra.buckets import bucket
from infra.clouds.aws import secrets
from infra.clouds.aws.access import AwsAccess, AwsAccessArgs
from infra.clouds.aws.budget import AwsBudget, AwsBudgetArgs
from infra.clouds.aws.fleet import AwsGpuFleet, AwsGpuFleetArgs
from infra.clouds.aws.health import grant_replace_self
from infra.clouds.aws.kubernetes import AwsEks, AwsEksArgs
from infra.clouds.aws.network import AwsNetwork, AwsNetworkArgs
from infra.clouds.aws.peering import AwsPeering, AwsPeeringArgs
from infra.clouds.aws.registry import AwsRegistry, AwsRegistryArgs
from infra.clouds.aws.rendezvous import AwsRendezvous, AwsRendezvousArgs
from infra.clouds.aws.sharedfs import AwsSharedFs, AwsSharedFsArgs
from infra.clouds.aws.storage import AwsStorage, AwsStorageArgs
from infra.clouds.base import CloudPlatform, Cluster
from infra.image import Registry
from infra.model.spec import Network
from infra.render.bundle import build as bundle
from infra.rendezvous import Site
from infra.resolve.groups import ResolvedGroup
from infra.resolve.sharedfs import SharedFsOutputs

# <account>.dkr.ecr.<region>.amazonaws.com[.cn]/<repository>[:tag|@digest] (Amazon ECR user guide,
# "Private registry concepts": the registry URL and repository name of an image reference)
ECR_REF = re.compile(r"^(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?/([a-z0-9._/-]+?)(?:[:@].*)?$")


def ecr_repository_arn(ref: str) -> str | None:
    """The repository ARN of an ECR image reference; None for any other registry."""
    m = ECR_REF.match(ref)
    if m is None:
        return None
    account, region, china, repo = m.groups()
    return f"arn:{'aws-cn' if china else 'aws'}:ecr:{region}:{account}:repository/{repo}"


class AwsPlatform(CloudPlatform[AwsNetwork, AwsStorage, AwsAccess]):
    CLOUD = "aws"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        # default_tags reach resources the components forget to tag; they tag explicitly too,
        # because policies and previews see only explicit inputs.
        return aws.Provider(f"{self.name}-{region}", region=region,
                            default_tags=aws.ProviderDefaultTagsArgs(tags=self.tags),
                            opts=pulumi.ResourceOptions(parent=self))

    def make_network(self, net: Network) -> AwsNetwork:
        region = self.region_of(net)
        stores = any(s.network == net.name for s in self.rendezvous_sites())
        return AwsNetwork(net.name, AwsNetworkArgs(net, region, self.tags, self.peer_cidrs()[net.name],
                                                   fabric=net.name in self.fabric_networks("kubernetes"),
                                                   store_range=rendezvous.store_range(str(net.subnets[0].cidr))
                                                   if stores else "", cluster=net.name in self.kubernetes_groups(),
                                                   vm_nodes=net.name in self.vm_networks()),
                          opts=self.provider_opts(region))

    def vpc_id(self, net: AwsNetwork) -> pulumi.Output[str]:
        return net.vpc.id

    def make_links(self, nets: dict[str, AwsNetwork]) -> None:
        for p in self.peerings():
            req, acc = self.spec.network(p.requester), self.spec.network(p.accepter)
            AwsPeering(p.name, AwsPeeringArgs(
                requester=req, accepter=acc, requester_net=nets[req.name], accepter_net=nets[acc.name],
                requester_region=self.region_of(req), accepter_region=self.region_of(acc),
                requester_provider=self.provider(self.region_of(req)),
                accepter_provider=self.provider(self.region_of(acc)), tags=self.tags),
                opts=pulumi.ResourceOptions(parent=self))

    def make_storage(self) -> AwsStorage:
        return AwsStorage(f"{self.name}-storage",
                          AwsStorageArgs(self.spec.storage, bucket(self.spec, self.CLOUD), bundle(), self.tags),
                          opts=self.provider_opts())

    def make_shared_fs(self, net: Network, built: AwsNetwork, storage: AwsStorage) -> SharedFsOutputs:
        region = self.region_of(net)
        shared = AwsSharedFs(f"{net.name}", AwsSharedFsArgs(
            network=net, vpc_id=built.vpc.id, subnet_ids=[s.id for s in built.private_subnets],
            allowed_cidrs=[str(net.cidr), *self.peer_cidrs()[net.name]],
            kms_key_arn=storage.key.arn if region == self.account.region else None, tags=self.tags),
            opts=self.provider_opts(region))
        self.shared_components = {**getattr(self, "shared_components", {}), net.name: shared}
        return shared.outputs

    def bucket_name(self, storage: AwsStorage) -> pulumi.Output[str]:
        return storage.bucket.bucket

    def make_access(self, storage: AwsStorage) -> AwsAccess:
        self.access_name = f"{self.name}-access"
        self.access = AwsAccess(self.access_name, AwsAccessArgs(
            bucket_arn=storage.bucket.arn, key_arn=storage.key.arn, env=self.spec.env, tags=self.tags,
            groups=self.access_grants(), kubernetes=bool(self.kubernetes_groups())), opts=self.provider_opts())
        for net_name, shared in getattr(self, "shared_components", {}).items():
            # the roles of the nodes that mount it: its VM groups' own, and the EKS node role (the
            # EFS CSI driver's node plugin mounts for the pods with it) where a cluster group shares it
            mounting = [g for g in self.node_groups() if g.network == net_name and g.group.shared_fs]
            roles = [self.access.roles[f"{self.access_name}-{g.name}"].arn for g in mounting if g.kind == "vm"]
            if any(g.kind == "kubernetes" for g in mounting) and self.access.eks_node_role is not None:
                roles.append(self.access.eks_node_role.arn)
            shared.allow(net_name, roles)
        return self.access

    def trainer_images(self, nets: dict[str, AwsNetwork]) -> dict[str, pulumi.Output[str]]:
        """The images, and the nodes' right to pull them (their repository only, infra/clouds/aws/access.py)."""
        self.repository_arns: list[pulumi.Output[str]] = []
        images = super().trainer_images(nets)
        prebuilt = self.spec.training.prebuilt_images.get("aws")
        arn = ecr_repository_arn(str(prebuilt)) if prebuilt else None
        repos = [pulumi.Output.from_input(arn)] if arn else self.repository_arns
        self.access.allow_pull("pull", pulumi.Output.all(*repos).apply(lambda arns: [str(a) for a in arns]))
        return images

    def make_registry(self, nets: dict[str, AwsNetwork]) -> Registry:
        made = AwsRegistry(f"{self.name}-registry", AwsRegistryArgs(self.spec.env, self.tags), opts=self.provider_opts())
        self.repository_arns.append(made.repository.arn)
        return made.registry

    def make_rendezvous(self, site: Site, net: AwsNetwork, access: AwsAccess,
                        image: pulumi.Output[str]) -> pulumi.Resource:
        store = AwsRendezvous(f"{self.spec.env}-{site.name}", AwsRendezvousArgs(
            site=site, instance_type=self.store_instance_type(), vpc_id=net.vpc.id,
            subnet_id=net.private_subnets[0].id, instance_profile=access.profiles[site.name].name,
            user_data=self.store_user_data(site, image), provider=self.provider(self.region_of(site.network)),
            tags=self.tags, reservation=net.store_reservation), opts=pulumi.ResourceOptions(parent=self))
        self.store_clients[site.group] = store.clients.id
        return store.instance

    def make_key_secret(self, group: ResolvedGroup, key: pulumi.Output[str], access: AwsAccess) -> str:
        # In the stack's default region, with its bucket: the node asks there (STORAGE_REGION).
        return secrets.rendezvous_key(self.spec.env, group.name, key, access.profiles[group.name].role.apply(str),
                                      self.tags, pulumi.ResourceOptions(parent=self, provider=self.provider()))

    def make_fleet(self, group: ResolvedGroup, net: AwsNetwork, access: AwsAccess,
                   image: pulumi.Output[str]) -> pulumi.Output[list[str]]:
        subnets, zones = self.fleet_subnets(group, net.private_subnets)  # a zone candidate: that zone's only
        assert net.vm_security_group is not None  # made for every network with VM groups
        runs = [net.run_group(group.name, group.fabric is not None, self.tags)] if self.spans_nodes(group) else []
        fleet = AwsGpuFleet(group.name, AwsGpuFleetArgs(
            group=group, subnet_ids=[s.id for s in subnets], zones=zones,
            security_group_id=net.vm_security_group.id, instance_profile_arn=access.profiles[group.name].arn,
            user_data=self.user_data(group, image), provider=self.provider(group.region), tags=self.tags,
            after=self.after_store(group), store_clients=[*self.clients_of(group), *runs],
            moved_to=self.moved_to(group)),
            opts=pulumi.ResourceOptions(parent=self))
        # A node with a failed GPU hands itself back (gts-gpu-health.py): that one call, on its own group.
        grant_replace_self(group.name, access.profiles[group.name].role.apply(str), fleet.group,
                           pulumi.ResourceOptions(parent=fleet, provider=self.provider(group.region),
                                                      depends_on=self.after_store(group)))
        return fleet.capacity

    def make_cluster(self, net: Network, groups: list[ResolvedGroup], built: AwsNetwork, access: AwsAccess,
                     storage: AwsStorage, images: Mapping[str, pulumi.Output[str]]) -> Cluster:
        assert access.eks_cluster_role is not None and access.eks_node_role is not None
        region = self.region_of(net)
        assert built.security_group is not None  # made for every network with a cluster
        eks = AwsEks(f"{self.spec.env}-{net.name}", AwsEksArgs(
            spec=self.spec, groups=groups, teams=self.stack.teams, region=region, subnet_ids=[s.id for s in built.private_subnets],
            security_group_id=built.security_group.id, cluster_role_arn=access.eks_cluster_role.arn,
            node_role_arn=access.eks_node_role.arn, kms_key_arn=storage.key.arn, access=access, images=images,
            provider=self.provider(region), tags=self.tags, shared=self.shared.get(net.name)), opts=pulumi.ResourceOptions(parent=self))
        return Cluster(eks.cluster.name, eks.kubeconfig)

    def make_budget(self) -> None:
        # Budgets are global; they live with the default region's provider.
        AwsBudget(f"{self.name}-budget", AwsBudgetArgs(self.spec.budget, self.spec.env, self.tags,
                                                       self.account.account_settings), opts=self.provider_opts())
