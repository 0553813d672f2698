"""AWS: the rendezvous store of a network's multi-node VM runs (infra/rendezvous.py): an
on-demand Ubuntu 22.04 instance at the store's fixed private address, running the trainer
image's store with Docker (cloudinit: GTS_MODE=rendezvous)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.rendezvous import DISK_GB, Site

# Canonical's public SSM parameter for the current Ubuntu 22.04 AMI (the store needs no GPU).
UBUNTU_PARAMETER = "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"


@dataclass
class AwsRendezvousArgs:
    site: Site
    instance_type: str
    subnet_id: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    instance_profile: pulumi.Output[str]  # name
    user_data: pulumi.Output[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class AwsRendezvous(pulumi.ComponentResource):
    def __init__(self, name: str, args: AwsRendezvousArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Rendezvous", name, None, opts)
        ami = aws.ssm.get_parameter_output(name=UBUNTU_PARAMETER,
                                           opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        # A fixed address cannot be held by two instances: the old one goes first on replacement,
        # and new user data (a new trainer image) replaces it (cloud-init reads it once).
        self.instance = aws.ec2.Instance(
            name, ami=ami.value, instance_type=args.instance_type, subnet_id=args.subnet_id,
            private_ip=args.site.address, vpc_security_group_ids=[args.security_group_id],
            iam_instance_profile=args.instance_profile, user_data_base64=args.user_data,
            user_data_replace_on_change=True,
            metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required",
                                                                 http_put_response_hop_limit=1),
            root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(volume_size=DISK_GB, volume_type="gp3",
                                                                  encrypted=True),
            tags={**args.tags, "Name": name}, volume_tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, delete_before_replace=True))
        self.register_outputs({"address": args.site.address})
