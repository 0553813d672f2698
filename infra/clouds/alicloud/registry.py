"""Alibaba Cloud: a Container Registry Enterprise Edition instance for the trainer image. The
namespace is public, but the instance answers only on the stack's VPCs (a linked VPC endpoint per
network with nodes, in the instance's region: infra/checks/cloud_rules.py refuses node networks elsewhere)
and, on the internet, only to `kubernetes.apiAccessCidrs` (where `pulumi up` pushes from): nodes
pull without credentials, and nobody else can reach it. The push uses the instance's temporary
login (GetAuthorizationToken, valid one hour)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.image import Registry, registry_name

NAMESPACE = "gpu-training-stack"


@dataclass
class AlicloudRegistryArgs:
    env: str
    push_cidrs: list[str]
    endpoints: list[tuple[str, pulumi.Output[str], pulumi.Output[str]]]  # (network, vpc id, vswitch id)
    tags: dict[str, str]


class AlicloudRegistry(pulumi.ComponentResource):
    def __init__(self, name: str, args: AlicloudRegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.instance = alicloud.cr.RegistryEnterpriseInstance(
            # renewal_status AutoRenewal needs renew_period (both force a new instance when changed).
            f"{name}-acr", instance_name=registry_name(args.env), instance_type="Basic", payment_type="Subscription",
            period=1, renewal_status="AutoRenewal", renew_period=1, tags=args.tags, opts=child)
        namespace = alicloud.cs.RegistryEnterpriseNamespace(
            f"{name}-ns", instance_id=self.instance.id, name=NAMESPACE, auto_create=False,
            default_visibility="PUBLIC", opts=child)
        repo = alicloud.cs.RegistryEnterpriseRepo(
            f"{name}-trainer", instance_id=self.instance.id, namespace=namespace.name, name=f"{args.env}-trainer",
            repo_type="PUBLIC", summary="gpu-training-stack trainer image", tag_immutability=True, opts=child)
        links: list[pulumi.Resource] = [
            alicloud.cr.VpcEndpointLinkedVpc(f"{name}-{net}", instance_id=self.instance.id, module_name="Registry",
                                             vpc_id=vpc_id, vswitch_id=vswitch_id,
                                             enable_create_dns_record_in_pvzt=True, opts=child)
            for net, vpc_id, vswitch_id in args.endpoints]
        internet = alicloud.cr.InternetEndpoint(
            f"{name}-internet", instance_id=self.instance.id,
            entries=[alicloud.cr.InternetEndpointEntryArgs(entry=c, comment="pulumi up (push)") for c in args.push_cidrs],
            opts=child)
        # The instance lists its endpoints only once they are enabled: read it after both.
        found = alicloud.cs.get_registry_enterprise_instances_output(
            ids=self.instance.id.apply(lambda i: [i]), enable_details=True,
            opts=pulumi.InvokeOutputOptions(parent=self, depends_on=[internet, *links]))
        details = found.instances.apply(lambda instances: instances[0])
        path = pulumi.Output.all(namespace.name, repo.name).apply(lambda nr: f"{nr[0]}/{nr[1]}")
        public = details.apply(lambda d: d.public_endpoints[0])
        self.registry = Registry(
            push_repository=pulumi.Output.all(public, path).apply(lambda hp: f"{hp[0]}/{hp[1]}"),
            pull_repository=pulumi.Output.all(details.apply(lambda d: d.vpc_endpoints[0]), path).apply(
                lambda hp: f"{hp[0]}/{hp[1]}"),
            address=public, username=details.apply(lambda d: d.temp_username),
            password=pulumi.Output.secret(details.apply(lambda d: d.authorization_token)))
        self.register_outputs({"instanceId": self.instance.id})
