"""Alibaba Cloud GPU VM fleet: an ECS launch template (hardened metadata, encrypted ESSD system
and scratch disks, RAM role, user data) and an ESS scaling group over several instance types
with spot strategy and an on-demand base; scheduled tasks for the node group's schedule.
Reserved groups are PrePaid ECS instances instead (ESS does not buy prepaid capacity)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_alicloud as alicloud

from infra.clouds.alicloud import reservation
from infra.core.names import fit
from infra.core.schedule import RENEW_REPLACE, recurrence_window
from infra.resolve.groups import SYSTEM_DISK_GB, ResolvedGroup, schedule_bounds
from infra.clouds import fixed_instances  # the profile's answer, read here by the fleet and its tests

IMAGE_REGEX = "^ubuntu_22_04_x64"
ESSD = "cloud_essd"


def spot_strategy(group: ResolvedGroup) -> str:
    if not group.spot and not group.market.bursts_to_spot:
        return "NoSpot"
    return "SpotWithPriceLimit" if group.price_cap else "SpotAsPriceGo"



@dataclass
class AlicloudGpuFleetArgs:
    group: ResolvedGroup
    vpc_id: pulumi.Output[str]
    switch_ids: list[pulumi.Output[str]]
    zones: list[str]
    security_group_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    user_data: pulumi.Input[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    env: str
    after: list[pulumi.Resource] = field(default_factory=list)  # its rendezvous store, created first
    # its rendezvous store's client group: the one security group the store admits (infra/rendezvous.py)
    store_clients: list[pulumi.Output[str]] = field(default_factory=list)


class AlicloudGpuFleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: AlicloudGpuFleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:GpuFleet", name, None, opts)
        g = args.group
        tags = g.tags(args.tags)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.after)
        image = alicloud.ecs.get_images_output(name_regex=IMAGE_REGEX, owners="system", most_recent=True,
                                               instance_type=g.types[0],
                                               opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        image_id = image.images.apply(lambda imgs: imgs[0].id)
        if fixed_instances(g):
            self.instances = self._reserved(name, args, image_id, tags, child)
            self.capacity: pulumi.Output[list[str]] = pulumi.Output.all(*[i.id for i in self.instances])
            self.register_outputs({"instanceIds": self.capacity})
            return
        if g.fabric is not None:
            # eRDMA: one zone, and the nodes' primary interface in HighPerformance mode, which only
            # a scaling configuration can say: alicloud_ecs_launch_template's network_interfaces
            # have no traffic mode (terraform-provider-alicloud resource_alicloud_ecs_launch_template.go;
            # resource_alicloud_ess_scaling_configuration.go writes NetworkInterfaceTrafficMode).
            self.group = self._group(name, g, args.switch_ids[:1], tags, child, template=False)
            self.configuration = self._erdma_configuration(name, args, image_id, tags, child)
        else:
            self.launch_template = self._launch_template(name, args, image_id, tags, child)
            self.group = self._group(name, g, args.switch_ids, tags, child)
        # elasticity-assurance: the reserved capacity the group's instances use (infra/clouds/alicloud/reservation.py)
        self.assurance = reservation.create(name, g, args.zones[0], tags, child)
        self._schedules(name, g, args.env, child)
        self.capacity = self.group.id.apply(lambda i: [i])
        self.register_outputs({"scalingGroupId": self.group.id})

    @staticmethod
    def _reserved(name: str, args: AlicloudGpuFleetArgs, image_id: pulumi.Output[str], tags: dict[str, str],
                  child: pulumi.ResourceOptions) -> list[alicloud.ecs.Instance]:
        g, disk_gb = args.group, args.group.scratch_disk_gb
        fabric, switches, placed = g.fabric, args.switch_ids, None
        if fabric is not None:
            # eRDMA instances: one zone, a LowLatency deployment set (the nodes near each other), the
            # primary ENI in HighPerformance mode, jumbo frames (MTU 8500) where the type takes them
            # (alicloud_instance network_interface_traffic_mode, deployment_set_id, enable_jumbo_frame).
            switches = switches[:1]
            placed = alicloud.ecs.EcsDeploymentSet(f"{name}-ds", deployment_set_name=name, strategy="LowLatency",
                                                   description="eRDMA group: instances close together", opts=child)
        return [alicloud.ecs.Instance(
            f"{name}-{i}", instance_name=f"{name}-{i}", instance_type=g.types[0], image_id=image_id,
            instance_charge_type="PrePaid", period=1, period_unit="Month", renewal_status="AutoRenewal",
            vswitch_id=switches[i % len(switches)], security_groups=[args.security_group_id, *args.store_clients],
            deployment_set_id=placed.id if placed else None,
            network_interface_traffic_mode="HighPerformance" if fabric else None,
            enable_jumbo_frame=True if fabric and fabric.jumbo_frames else None,
            http_tokens="required", http_endpoint="enabled", role_name=args.role_name,
            system_disk_category=ESSD, system_disk_size=SYSTEM_DISK_GB, system_disk_encrypted=True,
            data_disks=[alicloud.ecs.InstanceDataDiskArgs(category=ESSD, size=disk_gb, encrypted=True)] if disk_gb else None,
            user_data=args.user_data, tags=tags, opts=child) for i in range(g.scaling.max)]

    @staticmethod
    def _launch_template(name: str, args: AlicloudGpuFleetArgs, image_id: pulumi.Output[str], tags: dict[str, str],
                         child: pulumi.ResourceOptions) -> alicloud.ecs.EcsLaunchTemplate:
        g, disk_gb = args.group, args.group.scratch_disk_gb
        return alicloud.ecs.EcsLaunchTemplate(
            f"{name}-lt", launch_template_name=f"{name}-lt", image_id=image_id, instance_type=g.types[0],
            instance_charge_type="PostPaid", spot_strategy=spot_strategy(g),
            spot_price_limit=g.price_cap,
            security_group_ids=[args.security_group_id, *args.store_clients], vpc_id=args.vpc_id, vswitch_id=args.switch_ids[0],
            # Hardened mode: metadata only with a token (the spot watcher and the trainer ask for one);
            # hop limit 1, both run in the host's network namespace.
            http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=1,
            ram_role_name=args.role_name,
            system_disk=alicloud.ecs.EcsLaunchTemplateSystemDiskArgs(category=ESSD, size=SYSTEM_DISK_GB,
                                                                     encrypted=True, delete_with_instance=True),
            data_disks=[alicloud.ecs.EcsLaunchTemplateDataDiskArgs(category=ESSD, size=disk_gb, encrypted=True,
                                                                   delete_with_instance=True)] if disk_gb else None,
            user_data=args.user_data, template_tags=tags, tags=tags, opts=child)

    def _erdma_configuration(self, name: str, args: AlicloudGpuFleetArgs, image_id: pulumi.Output[str],
                             tags: dict[str, str], child: pulumi.ResourceOptions) -> alicloud.ess.ScalingConfiguration:
        """The launch template's settings as a scaling configuration, with the ERIs: the primary
        ENI and, for types with more ERIs, secondary ENIs, all HighPerformance, each with the
        training security group and the store's client group (with network_interfaces, the configuration "cannot specify
        SecurityGroupId or SecurityGroupIds": pulumi_alicloud ess ScalingConfigurationNetworkInterfaceArgs).
        Not expressible here, recorded in infra/data/capabilities.yaml sdkGaps: the metadata
        token mode and the deployment set (the ESS API has both, pulumi-alicloud 4.0.0's scaling
        configuration neither), and jumbo frames (alicloud_instance only)."""
        g, disk_gb = args.group, args.group.scratch_disk_gb
        assert g.fabric is not None
        nics = [alicloud.ess.ScalingConfigurationNetworkInterfaceArgs(
            instance_type="Primary" if i == 0 else "Secondary", network_interface_traffic_mode="HighPerformance",
            security_group_ids=[args.security_group_id, *args.store_clients]) for i in range(g.fabric.interfaces)]
        return alicloud.ess.ScalingConfiguration(
            f"{name}-config", scaling_group_id=self.group.id, scaling_configuration_name=name,
            image_id=image_id, instance_types=list(g.types), network_interfaces=nics,
            spot_strategy=spot_strategy(g),
            spot_price_limits=[alicloud.ess.ScalingConfigurationSpotPriceLimitArgs(instance_type=t,
                                                                                  price_limit=g.price_cap)
                               for t in g.types] if g.price_cap else None,
            http_endpoint="enabled", role_name=args.role_name,
            system_disk_category=ESSD, system_disk_size=SYSTEM_DISK_GB, system_disk_encrypted=True,
            data_disks=[alicloud.ess.ScalingConfigurationDataDiskArgs(category=ESSD, size=disk_gb, encrypted=True,
                                                                      delete_with_instance=True)] if disk_gb else None,
            user_data=args.user_data, active=True, enable=True, force_delete=True, tags=tags, opts=child)

    def _group(self, name: str, g: ResolvedGroup, switch_ids: list[pulumi.Output[str]], tags: dict[str, str],
               child: pulumi.ResourceOptions, template: bool = True) -> alicloud.ess.ScalingGroup:
        spot = g.spot or g.market.bursts_to_spot
        base = g.market.on_demand_base if g.spot else g.market.reserved_of(g.scaling.max) if spot else g.fleet_max
        return alicloud.ess.ScalingGroup(
            f"{name}-ess", scaling_group_name=name, min_size=g.fleet_min, max_size=g.fleet_max,
            desired_capacity=g.fleet_desired, vswitch_ids=switch_ids,
            launch_template_id=self.launch_template.id if template else None,
            launch_template_version="Latest" if template else None,
            launch_template_overrides=[alicloud.ess.ScalingGroupLaunchTemplateOverrideArgs(
                instance_type=t, spot_price_limit=g.price_cap) for t in g.types] if template else None,
            multi_az_policy="COST_OPTIMIZED" if spot else "BALANCE",
            on_demand_base_capacity=base,
            on_demand_percentage_above_base_capacity=0 if spot else 100,
            spot_instance_pools=min(len(g.types), 10) if spot else None,
            # Replace a spot node that gets its reclaim notice before it goes.
            spot_instance_remedy=spot, compensate_with_on_demand=spot,
            removal_policies=["NewestInstance", "OldestScalingConfiguration"],
            tags=tags, opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                ignore_changes=["desiredCapacity"])))

    def _schedules(self, name: str, g: ResolvedGroup, env: str, child: pulumi.ResourceOptions) -> None:
        start, end = (t.strftime("%Y-%m-%dT%H:%MZ") for t in recurrence_window())
        for action in g.schedule:
            lo, hi = schedule_bounds(g.group, action)
            alicloud.ess.ScheduledTask(
                # Task names are unique per account and region, so the stack's env is part of it.
                f"{name}-{action.name}", scheduled_task_name=fit(f"{env}-{name}-{action.name}", "essScheduledTask"),
                scaling_group_id=self.group.id, launch_time=start, recurrence_type="Cron",
                recurrence_value=action.cron, recurrence_end_time=end, desired_capacity=action.desired,
                min_value=lo, max_value=hi, task_enabled=True,
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                    ignore_changes=["launchTime"], replace_on_changes=RENEW_REPLACE, delete_before_replace=True)))
