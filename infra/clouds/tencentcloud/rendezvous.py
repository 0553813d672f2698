"""Tencent Cloud: the rendezvous store of a multi-node VM group (infra/rendezvous.py): a
pay-as-you-go Ubuntu 22.04 CVM at the store's fixed private address, running the trainer
image's store with Docker (cloudinit: GTS_MODE=rendezvous).

Reachable from its own group's nodes only: the store is in a security group of its own whose
one ingress rule admits the store's port from the group's client security group (which the
group's nodes carry beside the network's training group) by `source_security_id`; the
training group's rules for peered networks and the TKE pod range never reach it."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.clouds.tencentcloud.fleet import DISK, IMAGE_REGEX
from infra.rendezvous import DISK_GB, PORT, Site


@dataclass
class TencentRendezvousArgs:
    site: Site
    instance_type: str
    vpc_id: pulumi.Output[str]
    subnet_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    user_data: pulumi.Output[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class TencentRendezvous(pulumi.ComponentResource):
    clients: tencentcloud.security.Group  # what the group's nodes carry to reach the store
    security_group: tencentcloud.security.Group  # the store's own
    instance: tencentcloud.instance.Instance

    def __init__(self, name: str, args: TencentRendezvousArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Rendezvous", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        group, tags = args.site.group, args.tags
        # No rules of its own: a member matches the training group's rules first (orderly
        # groups), and this group is only a name the store's rule refers to.
        self.clients = tencentcloud.security.Group(
            f"{name}-clients", name=f"{name}-clients", description=f"Nodes of {group}: admitted to its rendezvous store",
            tags=tags, opts=child)
        self.security_group = tencentcloud.security.Group(
            f"{name}-sg", name=f"{name}-sg", description=f"Rendezvous store of {group}: its nodes only", tags=tags,
            opts=child)
        tencentcloud.security.GroupRuleSet(
            f"{name}-rules", security_group_id=self.security_group.id,
            ingresses=[tencentcloud.security.GroupRuleSetIngressArgs(
                action="ACCEPT", source_security_id=self.clients.id, protocol="TCP", port=str(PORT),
                description=f"rendezvous from the nodes of {group}")],
            egresses=[tencentcloud.security.GroupRuleSetEgressArgs(action="ACCEPT", cidr_block="0.0.0.0/0",
                                                                   protocol="ALL", description="egress")],
            opts=pulumi.ResourceOptions(parent=self.security_group, provider=args.provider))
        image_id = tencentcloud.images.get_instance_output(
            image_types=["PUBLIC_IMAGE"], image_name_regex=IMAGE_REGEX, instance_type=args.instance_type,
            opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self)).image_id
        # cloud-init writes files once per instance: a new trainer image replaces the store (old
        # one first: the address is fixed). The image is looked up for the first create only: a
        # new image_id re-installs the instance (the provider resets its system disk), and the
        # newest public image changes every few weeks.
        self.instance = tencentcloud.instance.Instance(
            name, instance_name=name, instance_type=args.instance_type, image_id=image_id,
            availability_zone=args.site.zone, vpc_id=args.vpc_id, subnet_id=args.subnet_id,
            private_ip=args.site.address, orderly_security_groups=[self.security_group.id],
            instance_charge_type="POSTPAID_BY_HOUR", system_disk_type=DISK, system_disk_size=DISK_GB,
            cam_role_name=args.role_name, allocate_public_ip=False, user_data=args.user_data,
            user_data_replace_on_change=True, tags=tags,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, delete_before_replace=True,
                                        ignore_changes=["imageId"]))
        self.register_outputs({"address": args.site.address, "securityGroupId": self.security_group.id,
                               "clientSecurityGroupId": self.clients.id})
