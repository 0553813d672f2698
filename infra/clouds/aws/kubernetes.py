"""AWS managed Kubernetes: an EKS cluster per network that has Kubernetes GPU groups, an untainted
system node group for the add-ons, managed GPU node groups (NVIDIA AL2023 AMI, capacity type
from the market, GPU taint, labels), EKS Pod Identity, the Cluster Autoscaler, and the
cloud-neutral node agents and training Job on the created cluster."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra import userdata
from infra.clouds.aws.access import AwsAccess
from infra.clouds.aws.autoscaler import EksAutoscalerArgs, EksClusterAutoscaler
from infra.clouds.aws.fleet import efa_interfaces
from infra.core import catalog as cat
from infra.core.names import fit
from infra.k8s.cluster import cluster_workloads
from infra.k8s.job import Identity
from infra.model.images import CLUSTER_AUTOSCALER, pulled
from infra.model.pools import pool_parts
from infra.model.spec import StackSpec
from infra.pods import NAMESPACE
from infra.resolve.access import trainer_grants
from infra.resolve.groups import LABEL_CAPACITY, LABEL_POOL, SYSTEM_DISK_GB, ResolvedGroup, schedule_bounds
from infra.resolve.sharedfs import SharedFsOutputs
from infra.teams.registry import Registry

# 1.33 left standard support on 2026-07-29 (extended support costs more per cluster-hour);
# 1.35 is in standard support until 2027-03-27 (EKS Kubernetes version calendar). The Cluster
# Autoscaler image follows the same minor version (infra/model/images.py).
EKS_VERSION = "1.35"
GPU_AMI = "AL2023_x86_64_NVIDIA"
SYSTEM_AMI = "AL2023_x86_64_STANDARD"
GPU_TAINT_KEY = "nvidia.com/gpu"
# Cluster Autoscaler reads a node group's labels and taints from EKS only while the group has
# never had nodes; these ASG tags keep scale-from-zero working after that (kubernetes/autoscaler
# cluster-autoscaler/cloudprovider/aws/README.md, "Auto-Discovery Setup").
NODE_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"


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


def node_metadata() -> aws.ec2.LaunchTemplateMetadataOptionsArgs:
    """IMDSv2 with hop limit 1: the node's own processes reach the metadata service, pods do not
    (so no pod can take the node role; EKS user guide, al2023: "the default hop count for managed
    node groups is set to 1"). No instance tags in IMDS: EKS puts `/` in node tag keys."""
    return aws.ec2.LaunchTemplateMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required",
                                                     http_put_response_hop_limit=1)


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
    access: AwsAccess  # makes the pods' roles
    images: Mapping[str, pulumi.Output[str]]  # group name -> its trainer image
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    shared: SharedFsOutputs | None = None  # the network's shared file system (networks[].sharedFs)
    teams: Registry | None = None  # the checked team registry kubernetes.queues names (the Stack's)


class AwsEks(pulumi.ComponentResource):
    cluster: aws.eks.Cluster
    kubeconfig: pulumi.Output[str]

    def __init__(self, name: str, args: AwsEksArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:EksGpuCluster", name, None, opts)
        spec, tags = args.spec, args.tags
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        cidrs = [str(c) for c in spec.kubernetes.api_access_cidrs]
        self.cluster = aws.eks.Cluster(
            f"{name}-eks", name=name, version=EKS_VERSION, role_arn=args.cluster_role_arn,
            # The private endpoint serves the VPC; the public one only the listed operators and CI
            # runners (EKS takes at most 40 CIDRs; the spec checks it), and none when empty.
            vpc_config=aws.eks.ClusterVpcConfigArgs(
                subnet_ids=args.subnet_ids, security_group_ids=[args.security_group_id],
                endpoint_private_access=True, endpoint_public_access=bool(cidrs),
                public_access_cidrs=cidrs or None),
            access_config=aws.eks.ClusterAccessConfigArgs(authentication_mode="API",
                                                          bootstrap_cluster_creator_admin_permissions=True),
            enabled_cluster_log_types=["api", "audit", "authenticator", "controllerManager", "scheduler"],
            encryption_config=aws.eks.ClusterEncryptionConfigArgs(
                resources=["secrets"], provider=aws.eks.ClusterEncryptionConfigProviderArgs(key_arn=args.kms_key_arn)),
            tags=tags, opts=child)
        # Pods get AWS permissions per service account through this agent (hostNetwork, so it
        # works with the nodes' IMDS hop limit of 1).
        self.pod_identity = aws.eks.Addon(f"{name}-pod-identity", cluster_name=self.cluster.name,
                                          addon_name="eks-pod-identity-agent", resolve_conflicts_on_create="OVERWRITE",
                                          resolve_conflicts_on_update="OVERWRITE", tags=tags, opts=child)
        self._network_addon(name, args, child)
        self.system = self._system_group(name, args, child)
        self.node_groups: list[aws.eks.NodeGroup] = []
        for g in args.groups:
            self.node_groups += self._node_groups(g, args, child)
        # The add-ons whose pods need nodes wait for them: before any node exists they stay
        # DEGRADED and a slow first `up` times out (terraform-aws-eks creates only the
        # `before_compute` add-ons, the VPC CNI and Pod Identity's agent, ahead of the node groups).
        self._addons(name, args, pulumi.ResourceOptions.merge(
            child, pulumi.ResourceOptions(depends_on=[self.system, *self.node_groups])))

        self.kubeconfig = pulumi.Output.secret(pulumi.Output.all(
            self.cluster.endpoint, self.cluster.certificate_authority.data).apply(
                lambda ec: kubeconfig(name, args.region, ec[0], ec[1])))
        # The EKS NVIDIA AMI has the driver but not the device plugin.
        k8s_provider = cluster_workloads(name, self.kubeconfig, [self.system, *self.node_groups], spec, args.groups,
                                         parent=self, device_plugin=True, trainer_images=args.images, shared=args.shared, teams=args.teams,
                                         identities=self._pod_identities(name, args, child))
        EksClusterAutoscaler(f"{name}-ca", EksAutoscalerArgs(
            cluster_name=self.cluster.name, asg_names=[ng.resources.apply(_asg_name) for ng in self.node_groups],
            region=args.region,
            image=pulled(CLUSTER_AUTOSCALER, spec.clouds["aws"].mirrors), system_selector={LABEL_POOL: "system"},
            pod_identity_agent=self.pod_identity, aws_provider=args.provider, k8s_provider=k8s_provider, tags=tags),
            opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"clusterName": self.cluster.name})

    def _network_addon(self, name: str, args: AwsEksArgs, child: pulumi.ResourceOptions) -> None:
        """The VPC CNI, before the node groups (their nodes need it to become Ready).
        NetworkPolicy is enforced on EKS by the VPC CNI's network policy agent, off until the
        add-on's configuration turns it on (EKS user guide, "Restrict Pod network traffic with
        Kubernetes network policies": enableNetworkPolicy on the vpc-cni add-on, v1.14 or later)."""
        aws.eks.Addon(f"{name}-vpc-cni", cluster_name=self.cluster.name, addon_name="vpc-cni",
                      configuration_values=json.dumps({"enableNetworkPolicy": "true"}),
                      resolve_conflicts_on_create="OVERWRITE", resolve_conflicts_on_update="OVERWRITE", tags=args.tags,
                      opts=child)

    def _addons(self, name: str, args: AwsEksArgs, child: pulumi.ResourceOptions) -> None:
        """The add-ons that run on the nodes, once node groups exist: GPU node health, and the
        EFS CSI driver where pods mount the shared file system."""
        tags = args.tags
        # GPU node health for EKS node repair: the node monitoring agent reports the DCGM / Xid
        # conditions (AcceleratedHardwareReady) that node_repair_config acts on (EKS user guide
        # node-health and node-repair; FABRIC_AND_HEALTH.md 4.4).
        self.node_monitoring = aws.eks.Addon(f"{name}-node-monitoring", cluster_name=self.cluster.name,
                                             addon_name="eks-node-monitoring-agent",
                                             resolve_conflicts_on_create="OVERWRITE",
                                             resolve_conflicts_on_update="OVERWRITE", tags=tags, opts=child)
        if args.shared is not None and args.shared.spec.type == "efs" and any(g.group.shared_fs for g in args.groups):
            # Pods mount EFS through its access point with TLS and the node's role (the file system
            # policy admits nothing else): the EFS CSI driver, as an EKS add-on (EKS user guide,
            # efs-csi; static volumes need no controller permissions).
            aws.eks.Addon(f"{name}-efs-csi", cluster_name=self.cluster.name, addon_name="aws-efs-csi-driver",
                          resolve_conflicts_on_create="OVERWRITE", resolve_conflicts_on_update="OVERWRITE", tags=tags,
                          opts=child)

    def _pod_identities(self, name: str, args: AwsEksArgs, child: pulumi.ResourceOptions) -> dict[str, Identity]:
        """Each training group's pods get their group's grants through EKS Pod Identity: a role per
        group, associated with the group's service account (the SDKs in the pod pick it up)."""
        identities = {}
        for g in args.groups:
            account = f"{g.name}-trainer"
            role = args.access.pod_role(f"{name}-{g.name}-pods", f"{args.spec.env}-{g.name}-pods",
                                        trainer_grants(args.spec, g))
            aws.eks.PodIdentityAssociation(
                f"{name}-{g.name}-identity", cluster_name=self.cluster.name, namespace=NAMESPACE,
                service_account=account, role_arn=role.arn, tags=args.tags,
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[self.pod_identity])))
            identities[g.name] = Identity(service_account=account)
        return identities

    def _system_group(self, name: str, args: AwsEksArgs, child: pulumi.ResourceOptions) -> aws.eks.NodeGroup:
        """Untainted on-demand nodes for CoreDNS, the autoscaler and the other add-ons."""
        pool = cat.load_system_pools()["aws"]
        lt = aws.ec2.LaunchTemplate(
            f"{name}-system-lt", update_default_version=True, metadata_options=node_metadata(),
            block_device_mappings=[aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                device_name="/dev/xvda", ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                    volume_size=50, volume_type="gp3", encrypted="true", delete_on_termination="true"))],
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=args.tags)
                                for kind in ("instance", "volume")],
            tags=args.tags, opts=child)
        nodes = int(pool["nodes"])
        return aws.eks.NodeGroup(
            f"{name}-system", node_group_name=fit(f"{name}-system", "eksNodeGroup"), cluster_name=self.cluster.name,
            node_role_arn=args.node_role_arn,
            subnet_ids=args.subnet_ids, ami_type=SYSTEM_AMI, capacity_type="ON_DEMAND",
            instance_types=[str(pool["instanceType"])],
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(min_size=nodes, max_size=nodes, desired_size=nodes),
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str)),
            labels={LABEL_POOL: "system"}, tags=args.tags, opts=child)

    def _node_groups(self, g: ResolvedGroup, args: AwsEksArgs,
                     child: pulumi.ResourceOptions) -> list[aws.eks.NodeGroup]:
        spec, tags = args.spec, args.tags
        types, disk_gb = list(g.types), g.scratch_disk_gb
        subnets, fabric, placement = args.subnet_ids, g.fabric, None
        if fabric is not None:
            # EFA: one zone, a cluster placement group, one interface per network card carrying the
            # cluster's security group (node-to-control-plane, as pulumi-eks attaches) and the
            # training group's (its rules to itself both ways admit EFA).
            subnets = args.subnet_ids[:1]
            placement = aws.ec2.PlacementGroup(f"{g.name}-pg", strategy="cluster", tags=tags, opts=child)
            cluster_sg = self.cluster.vpc_config.cluster_security_group_id
        # A launch template gives managed nodes IMDSv2 and encrypted volumes; EKS picks the AMI
        # and merges its own NodeConfig into this MIME user data.
        lt = aws.ec2.LaunchTemplate(
            f"{g.name}-lt", update_default_version=True, user_data=userdata.for_cluster_group(spec, g, args.shared),
            metadata_options=node_metadata(),
            block_device_mappings=[aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                device_name="/dev/xvda",
                ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                    volume_size=max(SYSTEM_DISK_GB, disk_gb), volume_type="gp3", encrypted="true",
                    delete_on_termination="true"))],
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=tags)
                                for kind in ("instance", "volume")],
            network_interfaces=(efa_interfaces(fabric, [cluster_sg, args.security_group_id])
                                if fabric is not None else None),
            placement=aws.ec2.LaunchTemplatePlacementArgs(group_name=placement.name) if placement else None,
            tags=tags, opts=child)
        labels = {**g.labels(), "nvidia.com/gpu.present": "true"}
        groups = []
        for part in pool_parts(g.group):
            capacity = "SPOT" if part.spot else "ON_DEMAND"
            pool_labels = {**labels, LABEL_CAPACITY: "spot" if part.spot else "on-demand"}
            ng = aws.eks.NodeGroup(
                f"{g.name}-{part.suffix}", cluster_name=self.cluster.name, node_role_arn=args.node_role_arn,
                subnet_ids=subnets, ami_type=GPU_AMI, capacity_type=capacity, instance_types=types,
                scaling_config=aws.eks.NodeGroupScalingConfigArgs(min_size=part.min, max_size=part.max,
                                                                  desired_size=part.desired),
                launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str)),
                taints=[aws.eks.NodeGroupTaintArgs(key=GPU_TAINT_KEY, value="true", effect="NO_SCHEDULE")],
                labels=pool_labels, update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1), tags=tags,
                # A node whose GPUs the monitoring agent finds faulty is replaced (or rebooted) by EKS.
                node_repair_config=aws.eks.NodeGroupNodeRepairConfigArgs(enabled=True),
                # The autoscaler owns the desired size once the group exists.
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                    ignore_changes=["scalingConfig.desiredSize"])))
            groups.append(ng)
            self._node_template_tags(f"{g.name}-{part.suffix}", ng, pool_labels, child)
            if part.spot or not g.spot:
                self._schedule(g, ng, f"{g.name}-{part.suffix}", child, offset=g.market.on_demand_base if part.spot else 0)
        return groups

    def _node_template_tags(self, ng_name: str, ng: aws.eks.NodeGroup, labels: dict[str, str],
                            child: pulumi.ResourceOptions) -> None:
        """Labels and taint of the group's future nodes, on its ASG, for scale-from-zero. Not
        propagated: `/` in an instance tag key would fail launches (AWS EC2 user guide,
        work-with-tags-in-IMDS)."""
        asg_name = ng.resources.apply(_asg_name)
        template = {f"{NODE_TEMPLATE}/label/{k}": v for k, v in labels.items()}
        template[f"{NODE_TEMPLATE}/taint/{GPU_TAINT_KEY}"] = "true:NoSchedule"
        for i, (key, value) in enumerate(sorted(template.items())):
            aws.autoscaling.Tag(f"{ng_name}-template-{i}", autoscaling_group_name=asg_name,
                                tag=aws.autoscaling.TagTagArgs(key=key, value=value, propagate_at_launch=False),
                                opts=child)

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
