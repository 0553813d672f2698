"""Alibaba Cloud: the rendezvous store of a network's multi-node VM runs (infra/rendezvous.py):
a pay-as-you-go Ubuntu 22.04 ECS instance at the store's fixed private address, running the
trainer image's store with Docker (cloudinit: GTS_MODE=rendezvous)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.clouds.alicloud.fleet import ESSD, IMAGE_REGEX
from infra.rendezvous import DISK_GB, Site


@dataclass
class AlicloudRendezvousArgs:
    site: Site
    instance_type: str
    vswitch_id: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    user_data: pulumi.Output[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class AlicloudRendezvous(pulumi.ComponentResource):
    def __init__(self, name: str, args: AlicloudRendezvousArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Rendezvous", name, None, opts)
        image = alicloud.ecs.get_images_output(name_regex=IMAGE_REGEX, owners="system", most_recent=True,
                                               instance_type=args.instance_type,
                                               opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        # ECS updates user data in place with a reboot, but cloud-init writes files once per
        # instance: a new trainer image replaces the store instead (old one first: one address).
        self.instance = alicloud.ecs.Instance(
            name, instance_name=name, instance_type=args.instance_type,
            image_id=image.images.apply(lambda found: found[0].id), instance_charge_type="PostPaid",
            vswitch_id=args.vswitch_id, private_ip=args.site.address, security_groups=[args.security_group_id],
            http_tokens="required", http_endpoint="enabled", role_name=args.role_name,
            internet_max_bandwidth_out=0, system_disk_category=ESSD, system_disk_size=DISK_GB,
            system_disk_encrypted=True, user_data=args.user_data, tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, delete_before_replace=True,
                                        replace_on_changes=["userData"]))
        self.register_outputs({"address": args.site.address})
