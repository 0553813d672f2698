"""Tencent Cloud: the rendezvous store of a network's multi-node VM runs (infra/rendezvous.py):
a pay-as-you-go Ubuntu 22.04 CVM at the store's fixed private address, running the trainer
image's store with Docker (cloudinit: GTS_MODE=rendezvous)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.clouds.tencentcloud.fleet import DISK, IMAGE_REGEX
from infra.rendezvous import DISK_GB, Site


@dataclass
class TencentRendezvousArgs:
    site: Site
    instance_type: str
    vpc_id: pulumi.Output[str]
    subnet_id: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    user_data: pulumi.Output[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class TencentRendezvous(pulumi.ComponentResource):
    def __init__(self, name: str, args: TencentRendezvousArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Rendezvous", name, None, opts)
        image_id = tencentcloud.images.get_instance_output(
            image_types=["PUBLIC_IMAGE"], image_name_regex=IMAGE_REGEX, instance_type=args.instance_type,
            opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self)).image_id
        # cloud-init writes files once per instance: a new trainer image replaces the store (old
        # one first: the address is fixed).
        self.instance = tencentcloud.instance.Instance(
            name, instance_name=name, instance_type=args.instance_type, image_id=image_id,
            availability_zone=args.site.zone, vpc_id=args.vpc_id, subnet_id=args.subnet_id,
            private_ip=args.site.address, orderly_security_groups=[args.security_group_id],
            instance_charge_type="POSTPAID_BY_HOUR", system_disk_type=DISK, system_disk_size=DISK_GB,
            cam_role_name=args.role_name, allocate_public_ip=False, user_data=args.user_data,
            user_data_replace_on_change=True, tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, delete_before_replace=True))
        self.register_outputs({"address": args.site.address})
