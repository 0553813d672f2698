"""AWS managed Kubernetes: an EKS cluster per network that has Kubernetes GPU groups, managed
GPU node groups (NVIDIA AL2023 AMI, capacity type from the market, GPU taint, labels), and the
cloud-neutral device plugin and training Job on the created cluster."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra import userdata
from infra.groups import SYSTEM_DISK_GB, ResolvedGroup, schedule_bounds
from infra.k8s import cluster_workloads, pool_parts
from infra.spec import StackSpec

EKS_VERSION = "1.33"
GPU_AMI = "AL2023_x86_64_NVIDIA"


def kubeconfig(name: str, region: str, endpoint: str, ca_data: str) -> str:
    """A kubeconfig that authenticates with `aws eks get-token` (no static credentials)."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [{"name": name, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "users": [{"name": name, "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws",
            "args": ["eks", "get-token", "--cluster-name", name, "--region", region]}}}],
    })


@dataclass
class AwsEksArgs:
    spec: StackSpec
    groups: list[ResolvedGroup]
    region: str
    subnet_ids: list[pulumi.Output[str]]
    security_group_id: pulumi.Output[str]
    cluster_role_arn: pulumi.Output[str]
    node_role_arn: pulumi.Output[str]
    kms_key_arn: pulumi.Output[str]
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class AwsEks(pulumi.ComponentResource):
    cluster: aws.eks.Cluster
    kubeconfig: pulumi.Output[str]

    def __init__(self, name: str, args: AwsEksArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:EksGpuCluster", name, None, opts)
        spec, tags = args.spec, args.tags
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        prod = spec.env == "prod"
        self.cluster = aws.eks.Cluster(
            f"{name}-eks", name=name, version=EKS_VERSION, role_arn=args.cluster_role_arn,
            vpc_config=aws.eks.ClusterVpcConfigArgs(
                subnet_ids=args.subnet_ids, security_group_ids=[args.security_group_id],
                endpoint_private_access=True, endpoint_public_access=not prod),
            access_config=aws.eks.ClusterAccessConfigArgs(authentication_mode="API",
                                                          bootstrap_cluster_creator_admin_permissions=True),
            enabled_cluster_log_types=["api", "audit", "authenticator", "controllerManager", "scheduler"],
            encryption_config=aws.eks.ClusterEncryptionConfigArgs(
                resources=["secrets"], provider=aws.eks.ClusterEncryptionConfigProviderArgs(key_arn=args.kms_key_arn)),
            tags=tags, opts=child)

        self.node_groups: list[aws.eks.NodeGroup] = []
        for g in args.groups:
            self.node_groups += self._node_groups(name, g, args, child)

        self.kubeconfig = pulumi.Output.secret(pulumi.Output.all(
            self.cluster.endpoint, self.cluster.certificate_authority.data).apply(
                lambda ec: kubeconfig(name, args.region, ec[0], ec[1])))
        # The EKS NVIDIA AMI has the driver but not the device plugin.
        cluster_workloads(name, self.kubeconfig, self.node_groups, spec, args.groups, parent=self,
                          device_plugin=True)
        self.register_outputs({"clusterName": self.cluster.name})

    def _node_groups(self, name: str, g: ResolvedGroup, args: AwsEksArgs,
                     child: pulumi.ResourceOptions) -> list[aws.eks.NodeGroup]:
        spec, tags = args.spec, args.tags
        types, disk_gb = list(g.types), g.scratch_disk_gb
        # A launch template gives managed nodes IMDSv2 and encrypted volumes; EKS picks the AMI.
        ctx = userdata.node_context(spec, g)
        lt = aws.ec2.LaunchTemplate(
            f"{g.name}-lt", update_default_version=True, user_data=userdata.for_eks(ctx),
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=2),
            block_device_mappings=[aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                device_name="/dev/xvda",
                ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                    volume_size=max(SYSTEM_DISK_GB, disk_gb), volume_type="gp3", encrypted="true", delete_on_termination="true"))],
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=tags)
                                for kind in ("instance", "volume")],
            tags=tags, opts=child)
        labels = {**g.labels(), "nvidia.com/gpu.present": "true"}
        groups = []
        for part in pool_parts(g.group):
            suffix, lo, hi, desired = part.suffix, part.min, part.max, part.desired
            capacity = "SPOT" if part.spot else "ON_DEMAND"
            ng = aws.eks.NodeGroup(
                f"{g.name}-{suffix}", cluster_name=self.cluster.name, node_role_arn=args.node_role_arn,
                subnet_ids=args.subnet_ids, ami_type=GPU_AMI, capacity_type=capacity, instance_types=types,
                scaling_config=aws.eks.NodeGroupScalingConfigArgs(min_size=lo, max_size=hi, desired_size=desired),
                launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str)),
                taints=[aws.eks.NodeGroupTaintArgs(key="nvidia.com/gpu", value="true", effect="NO_SCHEDULE")],
                labels={**labels, "gpu-training-stack/capacity": capacity.lower()},
                update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
                tags=tags,
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                    ignore_changes=["scalingConfig.desiredSize"])))
            groups.append(ng)
            if capacity == "SPOT" or not g.spot:
                self._schedule(g, ng, f"{g.name}-{suffix}", child,
                               offset=g.market.on_demand_base if capacity == "SPOT" else 0)
        return groups

    def _schedule(self, g: ResolvedGroup, ng: aws.eks.NodeGroup, ng_name: str, child: pulumi.ResourceOptions,
                  offset: int) -> None:
        """Scheduled actions on the node group's own Auto Scaling group; `offset` nodes are the
        separate on-demand base group."""
        asg_name = ng.resources.apply(_asg_name)
        for action in g.schedule:
            lo, hi = schedule_bounds(g.group, action)
            aws.autoscaling.Schedule(
                f"{ng_name}-{action.name}", scheduled_action_name=action.name, autoscaling_group_name=asg_name,
                recurrence=action.cron, time_zone="Etc/UTC", desired_capacity=max(0, action.desired - offset),
                min_size=max(0, lo - offset), max_size=max(1, hi - offset), opts=child)


def _asg_name(resources: Sequence[aws.eks.outputs.NodeGroupResource]) -> str:
    """The Auto Scaling group EKS made for a managed node group."""
    groups = resources[0].autoscaling_groups if resources else None
    if not groups or not groups[0].name:
        raise ValueError("EKS reported no Auto Scaling group for the node group")
    return groups[0].name
