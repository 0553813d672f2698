"""Tencent Cloud GPU VM fleet. Elastic capacity is Auto Scaling (a launch configuration and a
scaling group; SPOTPAID one-time spot with a price cap, or POSTPAID_BY_HOUR), with scheduled
actions for the node group's schedule. Fixed capacity — the on-demand base of a spot group,
and reserved (PREPAID) groups — is CVM instances with encrypted data disks."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta, timezone

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.core.schedule import RENEW_REPLACE, cron_in_beijing, recurrence_window
from infra.resolve.groups import SYSTEM_DISK_GB, ResolvedGroup, schedule_bounds
from infra.clouds import fixed_instances  # the profile's answer, read here by the fleet and its tests

IMAGE_REGEX = "Ubuntu Server 22.04"
DISK = "CLOUD_HSSD"
CHINA = timezone(timedelta(hours=8))  # Tencent Cloud APIs take Beijing time



def spot_max_price(group: ResolvedGroup) -> str:
    """The spot cap as Tencent wants it: a decimal string in the account's currency. SPOTPAID needs
    one (`spot_max_price` and `spot_instance_type` "at the same time", as_scaling_config and
    kubernetes_node_pool docs; without it the provider sends MaxPrice ""): the spec's cap, or the
    on-demand price when the spec gives none (the plan says which)."""
    return f"{group.bid_cap:.4f}"


@dataclass
class TencentGpuFleetArgs:
    group: ResolvedGroup
    vpc_id: pulumi.Output[str]
    subnet_ids: list[pulumi.Output[str]]
    zones: list[str]
    security_group_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    user_data: pulumi.Input[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    after: list[pulumi.Resource] = field(default_factory=list)  # its rendezvous store, created first
    # its rendezvous store's client group: the one security group the store admits (infra/rendezvous.py)
    store_clients: list[pulumi.Output[str]] = field(default_factory=list)
    moved_to: str | None = None  # at a zone candidate other than the declared first zone: that zone (CloudPlatform.moved_to)


class TencentGpuFleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: TencentGpuFleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:GpuFleet", name, None, opts)
        g = args.group
        tags = g.tags(args.tags)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.after)
        image_id = tencentcloud.images.get_instance_output(
            image_types=["PUBLIC_IMAGE"], image_name_regex=IMAGE_REGEX, instance_type=g.types[0],
            opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self)).image_id
        fixed = fixed_instances(g)  # the rest scales in an AS group
        self.hpc: tencentcloud.cvm.HpcCluster | None = None
        if g.fabric is not None:
            # HCC: every node is a CVM instance placed in an HCC cluster in the group's zone. AS
            # launch configurations and TKE node pools cannot take hpc_cluster_id in
            # tencentcloud-iac-pulumi (the AS API's CreateLaunchConfiguration.HpcClusterId is not
            # exposed), tencentcloud_instance can: the group is fixed instances (infra/fabric.py
            # refuses min != max and schedules), a reclaimed or failed one is recreated by the next
            # `pulumi up --refresh`, and the run goes on without it meanwhile (elastic rendezvous,
            # MIN_NNODES), as on the other fleets after a spot notice (gts-spot-watch).
            # An HCC is in one zone for good: the provider's update changes its name and remark only
            # (resource_tc_cvm_hpc_cluster.go, ModifyHpcClusterAttribute), so a group moved to a zone
            # candidate gets a new one there (the old one goes once its instances are replaced).
            hcc = f"{name}-hcc-{args.moved_to}" if args.moved_to else f"{name}-hcc"
            self.hpc = tencentcloud.cvm.HpcCluster(hcc, zone=args.zones[0], name=name,
                                                   remark="gpu-training-stack HCC group", opts=child)
        self.instances = [self._instance(f"{name}-{i}", i, args, image_id, tags, child, self.hpc)
                          for i in range(fixed)]
        if g.fleet_max - fixed <= 0:
            self.capacity: pulumi.Output[list[str]] = pulumi.Output.all(*[i.id for i in self.instances])
            self.register_outputs({"instanceIds": self.capacity})
            return
        self.group = self._group(name, args, image_id, fixed, tags, child)
        self._schedules(name, g, fixed, child)
        # The on-demand base instances and the scaling group that adds the rest.
        self.capacity = pulumi.Output.all(*[i.id for i in self.instances], self.group.id)
        self.register_outputs({"scalingGroupId": self.group.id})

    @staticmethod
    def _instance(name: str, i: int, args: TencentGpuFleetArgs, image_id: pulumi.Output[str], tags: dict[str, str],
                  child: pulumi.ResourceOptions, hpc: tencentcloud.cvm.HpcCluster | None = None
                  ) -> tencentcloud.instance.Instance:
        g, disk_gb = args.group, args.group.scratch_disk_gb
        reserved = g.market.prepaid
        # An HCC node is in the HCC's zone; a spot one is SPOTPAID ("must set spot_instance_type and
        # spot_max_price at the same time", tencentcloud_instance doc).
        zones, subnets = (args.zones[:1], args.subnet_ids[:1]) if hpc else (args.zones, args.subnet_ids)
        spot = hpc is not None and g.spot and i >= g.market.on_demand_base
        charge = "PREPAID" if reserved else "SPOTPAID" if spot else "POSTPAID_BY_HOUR"
        return tencentcloud.instance.Instance(
            name, instance_name=name, instance_type=g.types[0], image_id=image_id,
            availability_zone=zones[i % len(zones)], vpc_id=args.vpc_id,
            subnet_id=subnets[i % len(subnets)], orderly_security_groups=[args.security_group_id, *args.store_clients],
            hpc_cluster_id=hpc.id if hpc else None,
            spot_instance_type="ONE-TIME" if spot else None, spot_max_price=spot_max_price(g) if spot else None,
            instance_charge_type=charge,
            instance_charge_type_prepaid_period=1 if reserved else None,
            instance_charge_type_prepaid_renew_flag="NOTIFY_AND_AUTO_RENEW" if reserved else None,
            system_disk_type=DISK, system_disk_size=SYSTEM_DISK_GB,
            data_disks=[tencentcloud.instance.InstanceDataDiskArgs(data_disk_type=DISK, data_disk_size=disk_gb,
                                                                   encrypt=True, delete_with_instance=True)]
            if disk_gb else None,
            cam_role_name=args.role_name, allocate_public_ip=False, user_data=args.user_data, tags=tags,
            # The image lookup answers the newest matching image; a changed image_id reinstalls the
            # instance's system disk in place (terraform-provider-tencentcloud resource_tc_instance
            # Update: ResetInstance), mid-run on a reserved node. A routine `up` keeps the image it
            # was created with; `pulumi up --replace <urn>` moves one to a new image on purpose.
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=["imageId"])))

    @staticmethod
    def _group(name: str, args: TencentGpuFleetArgs, image_id: pulumi.Output[str], fixed: int, tags: dict[str, str],
               child: pulumi.ResourceOptions) -> tencentcloud.as_.ScalingGroup:
        g, disk_gb, spot = args.group, args.group.scratch_disk_gb, args.group.spot
        # tencentcloud-iac-pulumi 0.2.3 cannot set Encrypt on a launch configuration's data
        # disks (the AS API can): see infra/data/capabilities.yaml.
        config = tencentcloud.as_.ScalingConfig(
            f"{name}-config", configuration_name=f"{name}-config", image_id=image_id, instance_types=list(g.types),
            instance_charge_type="SPOTPAID" if spot else "POSTPAID_BY_HOUR",
            spot_instance_type="one-time" if spot else None,
            spot_max_price=spot_max_price(g) if spot else None,
            security_group_ids=[args.security_group_id, *args.store_clients], cam_role_name=args.role_name,
            system_disk_type=DISK, system_disk_size=SYSTEM_DISK_GB,
            data_disks=[tencentcloud.as_.ScalingConfigDataDiskArgs(disk_type=DISK, disk_size=disk_gb,
                                                                   delete_with_instance=True)] if disk_gb else None,
            public_ip_assigned=False, internet_max_bandwidth_out=0, user_data=args.user_data,
            instance_tags=tags, tags=tags, opts=child)
        return tencentcloud.as_.ScalingGroup(
            f"{name}-asg", scaling_group_name=name, configuration_id=config.id, vpc_id=args.vpc_id,
            subnet_ids=args.subnet_ids, min_size=max(0, g.fleet_min - fixed), max_size=g.fleet_max - fixed,
            desired_capacity=max(0, g.fleet_desired - fixed), multi_zone_subnet_policy="EQUALITY",
            retry_policy="INCREMENTAL_INTERVALS", termination_policies="NEWEST_INSTANCE",
            tags=tags, opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                ignore_changes=["desiredCapacity"])))

    def _schedules(self, name: str, g: ResolvedGroup, fixed: int, child: pulumi.ResourceOptions) -> None:
        start, end = (t.isoformat() for t in recurrence_window(CHINA))
        for action in g.schedule:
            lo, hi = schedule_bounds(g.group, action)
            tencentcloud.as_.Schedule(
                f"{name}-{action.name}", schedule_action_name=action.name, scaling_group_id=self.group.id,
                recurrence=cron_in_beijing(action.cron), start_time=start, end_time=end,
                desired_capacity=max(0, action.desired - fixed),
                min_size=max(0, lo - fixed), max_size=max(0, hi - fixed),
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                    ignore_changes=["startTime"], replace_on_changes=RENEW_REPLACE, delete_before_replace=True)))
