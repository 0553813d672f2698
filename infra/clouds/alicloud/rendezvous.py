"""Alibaba Cloud: the rendezvous store of a multi-node VM group (infra/rendezvous.py): a
pay-as-you-go Ubuntu 22.04 ECS instance at the store's fixed private address, running the
trainer image's store with Docker (cloudinit: GTS_MODE=rendezvous).

Reachable from its own group's nodes only: the store is in a security group of its own whose
one ingress rule admits the store's port from the group's client security group (which the
group's nodes carry beside the network's training group) by `source_security_group_id`; the
training group's rules for peered networks and the ACK pod range never reach it."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.clouds.alicloud.fleet import ESSD, IMAGE_REGEX
from infra.rendezvous import DISK_GB, PORT, Site


@dataclass
class AlicloudRendezvousArgs:
    site: Site
    instance_type: str
    vpc_id: pulumi.Output[str]
    vswitch_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    user_data: pulumi.Output[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class AlicloudRendezvous(pulumi.ComponentResource):
    clients: alicloud.ecs.SecurityGroup  # what the group's nodes carry to reach the store
    security_group: alicloud.ecs.SecurityGroup  # the store's own
    instance: alicloud.ecs.Instance

    def __init__(self, name: str, args: AlicloudRendezvousArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Rendezvous", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        group, tags = args.site.group, args.tags
        self.clients = alicloud.ecs.SecurityGroup(
            f"{name}-clients", vpc_id=args.vpc_id, security_group_name=f"{name}-clients", security_group_type="normal",
            description=f"Nodes of {group}: admitted to its rendezvous store", tags=tags, opts=child)
        self.security_group = alicloud.ecs.SecurityGroup(
            f"{name}-sg", vpc_id=args.vpc_id, security_group_name=f"{name}-sg", security_group_type="normal",
            description=f"Rendezvous store of {group}: its nodes only", tags=tags, opts=child)
        sg = pulumi.ResourceOptions(parent=self.security_group, provider=args.provider)
        alicloud.ecs.SecurityGroupRule(
            f"{name}-from-group", type="ingress", ip_protocol="tcp", port_range=f"{PORT}/{PORT}",
            security_group_id=self.security_group.id, source_security_group_id=self.clients.id, policy="accept",
            description=f"rendezvous from the nodes of {group}", opts=sg)
        alicloud.ecs.SecurityGroupRule(
            f"{name}-egress", type="egress", ip_protocol="all", port_range="-1/-1",
            security_group_id=self.security_group.id, cidr_ip="0.0.0.0/0", policy="accept",
            description="egress (packages, registry, bucket)", opts=sg)
        image = alicloud.ecs.get_images_output(name_regex=IMAGE_REGEX, owners="system", most_recent=True,
                                               instance_type=args.instance_type,
                                               opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        # ECS updates user data in place with a reboot, but cloud-init writes files once per
        # instance: a new trainer image replaces the store instead (old one first: one address).
        # The image is looked up for the first create only: a new image_id replaces the system
        # disk (re-installs the store mid-run), and the newest image changes every few weeks.
        self.instance = alicloud.ecs.Instance(
            name, instance_name=name, instance_type=args.instance_type,
            image_id=image.images.apply(lambda found: found[0].id), instance_charge_type="PostPaid",
            vswitch_id=args.vswitch_id, private_ip=args.site.address, security_groups=[self.security_group.id],
            http_tokens="required", http_endpoint="enabled", role_name=args.role_name,
            internet_max_bandwidth_out=0, system_disk_category=ESSD, system_disk_size=DISK_GB,
            system_disk_encrypted=True, user_data=args.user_data, tags=tags,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, delete_before_replace=True,
                                        replace_on_changes=["userData"], ignore_changes=["imageId"]))
        self.register_outputs({"address": args.site.address, "securityGroupId": self.security_group.id,
                               "clientSecurityGroupId": self.clients.id})
