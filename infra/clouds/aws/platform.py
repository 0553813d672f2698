"""The AWS side of a stack: networks, peerings, storage, access, GPU fleets, EKS, budget."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra import userdata
from infra.clouds.aws.access import AwsAccess, AwsAccessArgs
from infra.clouds.aws.budget import AwsBudget, AwsBudgetArgs
from infra.clouds.aws.kubernetes import AwsEks, AwsEksArgs
from infra.clouds.aws.fleet import AwsGpuFleet, AwsGpuFleetArgs
from infra.clouds.aws.network import AwsNetwork, AwsNetworkArgs
from infra.clouds.aws.peering import AwsPeering, AwsPeeringArgs
from infra.clouds.aws.storage import AwsStorage, AwsStorageArgs, checkpoint_root
from infra.clouds import checkpoint_url as group_checkpoint_url
from infra.clouds.base import CHECKPOINT_PREFIX, DATASET_PREFIX, CloudPlatform


class AwsPlatform(CloudPlatform):
    CLOUD = "aws"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        # default_tags reach resources the components forget to tag; they tag explicitly too,
        # because policies and previews see only explicit inputs.
        return aws.Provider(f"{self.name}-{region}", region=region,
                            default_tags=aws.ProviderDefaultTagsArgs(tags=self.tags),
                            opts=pulumi.ResourceOptions(parent=self))

    def build(self) -> None:
        spec, tags, region = self.spec, self.tags, self.account.region
        peer_cidrs = self.peer_cidrs()

        nets: dict[str, AwsNetwork] = {}
        for net in self.networks():
            net_region = spec.region_of(net)
            nets[net.name] = AwsNetwork(net.name, AwsNetworkArgs(net, net_region, tags, peer_cidrs[net.name]),
                                        opts=self.provider_opts(net_region))
        for p in self.peerings():
            req, acc = spec.network(p.requester), spec.network(p.accepter)
            AwsPeering(p.name, AwsPeeringArgs(
                requester=req, accepter=acc, requester_net=nets[req.name], accepter_net=nets[acc.name],
                requester_region=spec.region_of(req), accepter_region=spec.region_of(acc),
                requester_provider=self.providers[spec.region_of(req)],
                accepter_provider=self.providers[spec.region_of(acc)], tags=tags),
                opts=pulumi.ResourceOptions(parent=self))

        storage = AwsStorage(f"{self.name}-storage", AwsStorageArgs(spec.storage, region, tags),
                             opts=self.provider_opts(region))
        checkpoint_url = checkpoint_root(spec)
        access = AwsAccess(f"{self.name}-access", AwsAccessArgs(
            bucket_arn=storage.bucket.arn, key_arn=storage.key.arn, prefixes=[CHECKPOINT_PREFIX, DATASET_PREFIX],
            tags=tags, kubernetes=bool(self.kubernetes_groups())), opts=self.provider_opts(region))

        fleets: dict[str, pulumi.Output[list[str]]] = {}
        for g in self.vm_groups():
            net = spec.network(g.network)
            ctx = userdata.node_context(spec, g, group_checkpoint_url(spec, g))
            fleet = AwsGpuFleet(g.name, AwsGpuFleetArgs(
                spec=spec, group=g, subnet_ids=[s.id for s in nets[net.name].private_subnets],
                zones=[s.zone for s in net.subnets], security_group_id=nets[net.name].security_group.id,
                instance_profile_arn=access.instance_profile.arn, user_data=userdata.for_vm(ctx),
                provider=self.providers[spec.region_of(net)], tags=tags), opts=pulumi.ResourceOptions(parent=self))
            fleets[g.name] = fleet.capacity

        clusters: dict[str, pulumi.Output[str]] = {}
        kubeconfigs: dict[str, pulumi.Output[str]] = {}
        for net_name, kube_groups in self.kubernetes_groups().items():
            net = spec.network(net_name)
            assert access.eks_cluster_role is not None and access.eks_node_role is not None
            net_region = spec.region_of(net)
            eks = AwsEks(f"{spec.env}-{net.name}", AwsEksArgs(
                spec=spec, groups=kube_groups, region=net_region,
                subnet_ids=[s.id for s in nets[net.name].private_subnets],
                security_group_id=nets[net.name].security_group.id,
                cluster_role_arn=access.eks_cluster_role.arn, node_role_arn=access.eks_node_role.arn,
                kms_key_arn=storage.key.arn, checkpoint_url=checkpoint_url,
                provider=self.providers[net_region], tags=tags), opts=pulumi.ResourceOptions(parent=self))
            clusters[net.name] = eks.cluster.name
            kubeconfigs[net.name] = eks.kubeconfig

        # Budgets are global; they live with the default region's provider.
        AwsBudget(f"{self.name}-budget", AwsBudgetArgs(spec.budget, spec.env, tags), opts=self.provider_opts(region))

        self.export({name: n.vpc.id for name, n in nets.items()}, storage.bucket.bucket, checkpoint_url,
                    fleets, clusters, kubeconfigs)
