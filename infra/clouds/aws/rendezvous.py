"""AWS: the rendezvous store of a multi-node VM group (infra/rendezvous.py): an on-demand
Ubuntu 22.04 instance at the store's fixed private address, running the trainer image's store
with Docker (cloudinit: GTS_MODE=rendezvous).

Reachable from its own group's nodes only: the store has a security group of its own that
admits the store's port from the group's client security group (which the group's nodes carry
beside the network's training group), by reference, and nothing else; the training group's
peer and pod rules never reach it. Its address lies in the stores' range of the subnet, held by
an explicit subnet CIDR reservation: AWS assigns no address of it to anything (nodes, VPC CNI
pods, EFS mount targets) unless asked for that address by name."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.rendezvous import DISK_GB, PORT, Site

# Canonical's public SSM parameter for the current Ubuntu 22.04 AMI (the store needs no GPU).
UBUNTU_PARAMETER = "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"


@dataclass
class AwsRendezvousArgs:
    site: Site
    instance_type: str
    vpc_id: pulumi.Output[str]
    subnet_id: pulumi.Output[str]
    instance_profile: pulumi.Output[str]  # name
    user_data: pulumi.Output[str]  # base64
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    reservation: pulumi.Resource | None = None  # the network's reservation of the stores' range


class AwsRendezvous(pulumi.ComponentResource):
    clients: aws.ec2.SecurityGroup  # what the group's nodes carry to reach the store
    security_group: aws.ec2.SecurityGroup  # the store's own
    instance: aws.ec2.Instance

    def __init__(self, name: str, args: AwsRendezvousArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Rendezvous", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        group, tags = args.site.group, args.tags
        self.clients = aws.ec2.SecurityGroup(
            f"{name}-clients", vpc_id=args.vpc_id, description=f"Nodes of {group}: admitted to its rendezvous store",
            tags={**tags, "Name": f"{name}-clients"}, opts=child)
        self.security_group = aws.ec2.SecurityGroup(
            f"{name}-sg", vpc_id=args.vpc_id, description=f"Rendezvous store of {group}: its nodes only",
            tags={**tags, "Name": f"{name}-sg"}, opts=child)
        sg_child = pulumi.ResourceOptions(parent=self.security_group, provider=args.provider)
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-from-group", security_group_id=self.security_group.id,
            referenced_security_group_id=self.clients.id, ip_protocol="tcp", from_port=PORT, to_port=PORT,
            description=f"rendezvous from the nodes of {group}", tags=tags, opts=sg_child)
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-egress", security_group_id=self.security_group.id, cidr_ipv4="0.0.0.0/0", ip_protocol="-1",
            description="egress (packages, registry, bucket)", tags=tags, opts=sg_child)
        after = [args.reservation] if args.reservation is not None else []
        ami = aws.ssm.get_parameter_output(name=UBUNTU_PARAMETER,
                                           opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        # A fixed address cannot be held by two instances: the old one goes first on replacement,
        # and new user data (a new trainer image) replaces it (cloud-init reads it once). The AMI
        # is looked up for the first create only: `ami` forces a new instance, and the parameter
        # names a newer image every few weeks, which would replace the store mid-run on a routine
        # `up`.
        self.instance = aws.ec2.Instance(
            name, ami=ami.value, instance_type=args.instance_type, subnet_id=args.subnet_id,
            private_ip=args.site.address, vpc_security_group_ids=[self.security_group.id],
            iam_instance_profile=args.instance_profile, user_data_base64=args.user_data,
            user_data_replace_on_change=True,
            metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required",
                                                                 http_put_response_hop_limit=1),
            root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(volume_size=DISK_GB, volume_type="gp3",
                                                                  encrypted=True),
            tags={**tags, "Name": name}, volume_tags=tags,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, delete_before_replace=True,
                                        ignore_changes=["ami"], depends_on=after))
        self.register_outputs({"address": args.site.address, "securityGroupId": self.security_group.id,
                               "clientSecurityGroupId": self.clients.id})
