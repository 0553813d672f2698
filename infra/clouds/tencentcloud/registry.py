"""Tencent Cloud: a TCR instance for the trainer image. The namespace is public, but the
instance is reachable only from the stack's VPCs (a VPC attachment per network with nodes, its
domain resolved privately there; the instance's region only: infra/checks/cloud_rules.py refuses others) and, on the internet, only from `kubernetes.apiAccessCidrs`
(where `pulumi up` pushes from): nodes pull without credentials, nobody else reaches it."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.image import Registry, registry_name

NAMESPACE = "gpu-training-stack"


@dataclass
class TencentRegistryArgs:
    env: str
    push_cidrs: list[str]
    endpoints: list[tuple[str, pulumi.Output[str], pulumi.Output[str]]]  # (network, vpc id, subnet id)
    tags: dict[str, str]


class TencentRegistry(pulumi.ComponentResource):
    def __init__(self, name: str, args: TencentRegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.instance = tencentcloud.tcr.Instance(
            f"{name}-tcr", name=registry_name(args.env), instance_type="basic", open_public_operation=bool(args.push_cidrs),
            security_policies=[tencentcloud.tcr.InstanceSecurityPolicyArgs(cidr_block=c, description="pulumi up (push)")
                               for c in args.push_cidrs] or None,
            # The instance's own COS bucket holds only its images: remove it with the instance.
            delete_bucket=True, tags=args.tags, opts=child)
        namespace = tencentcloud.tcr.Namespace(f"{name}-ns", instance_id=self.instance.id, name=NAMESPACE,
                                               is_public=True, opts=child)
        repo = tencentcloud.tcr.Repository(f"{name}-trainer", instance_id=self.instance.id,
                                           namespace_name=namespace.name, name=f"{args.env}-trainer",
                                           brief_desc="gpu-training-stack trainer image", opts=child)
        for net, vpc_id, subnet_id in args.endpoints:
            tencentcloud.tcr.VpcAttachment(f"{name}-{net}", instance_id=self.instance.id, vpc_id=vpc_id,
                                           # the public domain itself resolves to the private endpoint here
                                           # (enable_vpc_domain_dns only adds a separate "-vpc" name)
                                           subnet_id=subnet_id, enable_public_domain_dns=True, opts=child)
        # The provider does not mark the token sensitive: keep it encrypted in the state.
        token = tencentcloud.tcr.Token(f"{name}-push", instance_id=self.instance.id, description="pulumi up pushes",
                                       opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["token"]))
        # One domain: the VPC attachment resolves it to the private endpoint inside the VPCs.
        url = pulumi.Output.all(self.instance.public_domain, namespace.name, repo.name).apply(
            lambda dnr: f"{dnr[0]}/{dnr[1]}/{dnr[2]}")
        self.registry = Registry(push_repository=url, pull_repository=url, address=self.instance.public_domain,
                                 username=token.user_name, password=pulumi.Output.secret(token.token))
        self.register_outputs({"instanceId": self.instance.id})
