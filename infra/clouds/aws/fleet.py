"""AWS GPU VM fleet: a launch template and an Auto Scaling group with a mixed instances policy
(several types, price-capacity-optimized spot, an on-demand base), capacity rebalancing, a
cluster placement group for multi-node training, and scheduled scaling."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.capacity.places import one_zone
from infra.clouds.aws import reservation
from infra.fabric import TypeFabric
from infra.resolve.groups import SYSTEM_DISK_GB, ResolvedGroup, schedule_bounds

# Deep Learning Base AMI with the NVIDIA driver, CUDA, Docker and the container toolkit.
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
ROOT_DEVICE = "/dev/sda1"  # Ubuntu AMIs
SCRATCH_DEVICE = "/dev/sdf"


@dataclass
class AwsGpuFleetArgs:
    group: ResolvedGroup
    subnet_ids: list[pulumi.Output[str]]
    zones: list[str]
    security_group_id: pulumi.Output[str]
    instance_profile_arn: pulumi.Output[str]
    user_data: pulumi.Input[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    after: list[pulumi.Resource] = field(default_factory=list)  # its rendezvous store, created first
    # its rendezvous store's client group: the one security group the store admits (infra/rendezvous.py)
    store_clients: list[pulumi.Output[str]] = field(default_factory=list)
    moved_to: str | None = None  # at a zone candidate other than the declared first zone: that zone (CloudPlatform.moved_to)



def block_devices(scratch_disk_gb: int) -> list[aws.ec2.LaunchTemplateBlockDeviceMappingArgs]:
    """Encrypted gp3 root; an encrypted gp3 scratch volume when local NVMe cannot hold the scratch."""
    devices = [aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name=ROOT_DEVICE,
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(volume_size=SYSTEM_DISK_GB, volume_type="gp3", encrypted="true",
                                                            delete_on_termination="true"))]
    if scratch_disk_gb:
        devices.append(aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
            device_name=SCRATCH_DEVICE,
            ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(volume_size=scratch_disk_gb, volume_type="gp3",
                                                                encrypted="true", delete_on_termination="true",
                                                                throughput=500, iops=6000)))
    return devices


def interface_types(fabric: TypeFabric) -> list[str]:
    """The interface type of each network card, card 0 first: "efa" (ENA+EFA) on card 0 and every
    efa_primary_every-th card, "efa-only" on the rest (layout (A) of the sources: pulumi-eks
    instances.ts, terraform-aws-eks, dstack, SkyPilot)."""
    every = fabric.efa_primary_every
    return ["efa" if i == 0 or (every and i % every == 0) else "efa-only" for i in range(fabric.interfaces)]


def efa_interfaces(fabric: TypeFabric, security_group_ids: list[pulumi.Input[str]]
                   ) -> list[aws.ec2.LaunchTemplateNetworkInterfaceArgs]:
    """One interface per network card: card 0 at device index 0 is ENA+EFA ("efa": it carries the
    node's IP), every other card at device index 1 "efa-only" (no IP address), except that P5
    takes ENA+EFA on every 4th card (EC2 user guide "EFA configuration for P5"). Sources:
    pulumi-eks nodes/instances.ts getEfaNetworkInterfaces ("EFA requires the first interface to
    have device index 0, and all the secondary interfaces to have device index 1"), terraform-aws-eks
    efa_network_interfaces, dstack and SkyPilot. The security groups go on each interface: a
    template with interfaces cannot also set vpc_security_group_ids (terraform launch_template doc:
    "Conflicts with network_interfaces.security_groups"). No subnet here: the ASG / EKS node group
    gives it (EKS: "will fail if set here"); no associate_public_ip_address: EC2 refuses it with more
    than one interface (InvalidParameterCombination, karpenter-provider-aws #5666)."""
    return [aws.ec2.LaunchTemplateNetworkInterfaceArgs(
        network_card_index=i, device_index=0 if i == 0 else 1, interface_type=kind,
        security_groups=security_group_ids, delete_on_termination="true")
        for i, kind in enumerate(interface_types(fabric))]


class AwsGpuFleet(pulumi.ComponentResource):
    launch_template: aws.ec2.LaunchTemplate
    group: aws.autoscaling.Group

    def __init__(self, name: str, args: AwsGpuFleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:GpuFleet", name, None, opts)
        g = args.group
        tags = g.tags(args.tags)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.after)
        # Multi-node training wants the nodes close together: a cluster placement group, which
        # AWS confines to one zone.
        # EFA works within one zone only (ParallelCluster efa-v3) and wants the same group.
        # A cluster placement group is bound to the zone of its first instances: a group moved to
        # a zone candidate gets a new one there (the old one goes once its instances are replaced).
        placement = None
        subnets = args.subnet_ids
        if one_zone(g.group, g.fabric):
            pg = f"{name}-pg-{args.moved_to}" if args.moved_to else f"{name}-pg"
            placement = aws.ec2.PlacementGroup(pg, strategy="cluster", tags=tags, opts=child)
            subnets = subnets[:1]
        # Reserved capacity: an On-Demand Capacity Reservation the launch template uses (reserved:
        # at the group's maximum; capacity-reservation without an id: its reservedNodes until its end).
        # Savings Plans / RIs and Capacity Blocks are bought outside IaC (infra/clouds/aws/reservation.py).
        self.reservation = reservation.create(name, g, args.zones[0], tags, child)
        self.launch_template = self._launch_template(name, args, tags, child)
        self.group = self._group(name, g, subnets, placement, tags, child)
        self._drain_and_schedules(name, g, child)
        self.capacity: pulumi.Output[list[str]] = self.group.name.apply(lambda n: [n])
        self.register_outputs({"autoscalingGroupName": self.group.name,
                               "launchTemplateId": self.launch_template.id})

    def _launch_template(self, name: str, args: AwsGpuFleetArgs, tags: dict[str, str],
                         child: pulumi.ResourceOptions) -> aws.ec2.LaunchTemplate:
        ami = aws.ssm.get_parameter_output(name=DLAMI_PARAMETER,
                                           opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        fabric = args.group.fabric
        return aws.ec2.LaunchTemplate(
            f"{name}-lt", image_id=ami.value, update_default_version=True,
            iam_instance_profile=aws.ec2.LaunchTemplateIamInstanceProfileArgs(arn=args.instance_profile_arn),
            # EFA: the interfaces carry the security groups (efa_interfaces); otherwise the template does.
            vpc_security_group_ids=None if fabric else [args.security_group_id, *args.store_clients],
            network_interfaces=efa_interfaces(fabric, [args.security_group_id, *args.store_clients]) if fabric else None,
            # IMDSv2 only, hop limit 1: the spot watcher and the trainer run in the host's network
            # namespace (`docker run --network host`) and reach it; a bridged container does not.
            # Instance tags in IMDS restrict tag keys (no `/`): the spec checks the stack's tags.
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=1,
                instance_metadata_tags="enabled"),
            block_device_mappings=block_devices(args.group.scratch_disk_gb),
            user_data=args.user_data,
            capacity_reservation_specification=reservation.reservation_spec(args.group, self.reservation),
            instance_market_options=reservation.market_options(args.group),
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=tags)
                                for kind in ("instance", "volume", "network-interface")],
            tags=tags, opts=child)

    def _group(self, name: str, g: ResolvedGroup, subnets: list[pulumi.Output[str]],
               placement: aws.ec2.PlacementGroup | None, tags: dict[str, str],
               child: pulumi.ResourceOptions) -> aws.autoscaling.Group:
        on_demand_base, above_base = reservation.on_demand_base(g)
        distribution = aws.autoscaling.GroupMixedInstancesPolicyInstancesDistributionArgs(
            on_demand_base_capacity=on_demand_base,
            on_demand_percentage_above_base_capacity=above_base,
            on_demand_allocation_strategy="prioritized",
            spot_allocation_strategy="price-capacity-optimized",
            spot_max_price=(f"{g.market.spot_max_price_usd:.4f}" if g.market.spot_max_price_usd else None))
        template = aws.autoscaling.GroupMixedInstancesPolicyLaunchTemplateLaunchTemplateSpecificationArgs(
            launch_template_id=self.launch_template.id, version="$Latest")
        return aws.autoscaling.Group(
            f"{name}-asg", min_size=g.fleet_min, max_size=g.fleet_max,
            desired_capacity=g.fleet_desired, vpc_zone_identifiers=subnets,
            capacity_rebalance=g.spot,
            placement_group=placement.id if placement else None,
            mixed_instances_policy=aws.autoscaling.GroupMixedInstancesPolicyArgs(
                instances_distribution=distribution,
                launch_template=aws.autoscaling.GroupMixedInstancesPolicyLaunchTemplateArgs(
                    launch_template_specification=template,
                    overrides=[aws.autoscaling.GroupMixedInstancesPolicyLaunchTemplateOverrideArgs(instance_type=t)
                               for t in g.types])),
            # A new node bootstraps (driver, runtime, image, dataset) for minutes before it trains:
            # its metrics count toward scaling decisions only after this warm-up.
            default_instance_warmup=300,
            tags=[aws.autoscaling.GroupTagArgs(key=k, value=v, propagate_at_launch=True) for k, v in tags.items()],
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=["desiredCapacity"])))

    def _drain_and_schedules(self, name: str, g: ResolvedGroup, child: pulumi.ResourceOptions) -> None:
        # A scale-in gives no spot-style notice: this hook holds a leaving instance for five minutes,
        # and the spot watcher sees it as the target lifecycle state "Terminated" in instance
        # metadata (EC2 Auto Scaling user guide, "Retrieve the target lifecycle state through
        # instance metadata") and checkpoints as on a reclaim.
        aws.autoscaling.LifecycleHook(f"{name}-drain", autoscaling_group_name=self.group.name,
                                      lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                                      heartbeat_timeout=300, default_result="CONTINUE", opts=child)
        for action in g.schedule:
            lo, hi = schedule_bounds(g.group, action)
            aws.autoscaling.Schedule(f"{name}-{action.name}", scheduled_action_name=action.name,
                                     autoscaling_group_name=self.group.name, recurrence=action.cron,
                                     time_zone="Etc/UTC", desired_capacity=action.desired,
                                     min_size=lo, max_size=hi, opts=child)
