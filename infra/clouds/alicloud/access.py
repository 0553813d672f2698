"""Alibaba Cloud RAM: one role per VM node group limited to that group's grants in the bucket
(infra/resolve/access.py), a role for the ACK nodes that reads only the node bundle (pods carry their
group's own role through RRSA, infra/clouds/alicloud/kubernetes.py), and ACK's account-wide
autoscaler role where this stack manages the account's settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_alicloud as alicloud

from infra.core.names import fit
from infra.resolve.access import CLUSTER_NODE, Grants

AUTOSCALER_ROLE = "AliyunCSManagedAutoScalerRole"  # the name ACK looks for


def bucket_policy(bucket: str, grants: Grants) -> str:
    # The versions too: the replacement budget's slots on this versioned bucket go to their oldest
    # version's writer (training/node/replace_budget.py); OSS RAM actions oss:ListObjectVersions,
    # oss:GetObjectVersion (help/en/oss/user-guide/authorization-syntax-and-elements).
    statements: list[dict[str, object]] = [
        {"Effect": "Allow", "Action": ["oss:ListObjects", "oss:ListObjectVersions"], "Resource": [f"acs:oss:*:*:{bucket}"],
         "Condition": {"StringLike": {"oss:Prefix": [f"{p}*" for p in grants.prefixes]}}},
        {"Effect": "Allow", "Action": ["oss:GetObject", "oss:GetObjectVersion"],
         "Resource": [f"acs:oss:*:*:{bucket}/{p}*" for p in grants.prefixes]}]
    if grants.writes:
        statements.append({"Effect": "Allow", "Action": ["oss:PutObject", "oss:DeleteObject", "oss:AbortMultipartUpload",
                                                         "oss:ListParts"],
                           "Resource": [f"acs:oss:*:*:{bucket}/{p}*" for p in grants.writes]})
    return json.dumps({"Version": "1", "Statement": statements})


def service_trust(service: str) -> str:
    return json.dumps({"Version": "1", "Statement": [{
        "Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Service": [service]}}]})


@dataclass
class AlicloudAccessArgs:
    bucket: str
    env: str
    tags: dict[str, str]
    groups: dict[str, Grants] = field(default_factory=dict)  # VM node groups
    kubernetes: bool = False
    autoscaler_role: bool = False  # create ACK's account-wide autoscaler role (one stack per account)


class AlicloudAccess(pulumi.ComponentResource):
    roles: dict[str, alicloud.ram.Role]
    ack_node_role: alicloud.ram.Role | None

    def __init__(self, name: str, args: AlicloudAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Access", name, None, opts)
        self.child = pulumi.ResourceOptions(parent=self)
        self.args = args
        self.roles = {group: self.role(f"{name}-{group}", f"{args.env}-{group}-node", service_trust("ecs.aliyuncs.com"),
                                       grants, f"GPU nodes of {group}: its dataset, its own checkpoints")
                      for group, grants in args.groups.items()}
        self.ack_node_role = None
        if args.kubernetes:
            self.ack_node_role = self.role(f"{name}-ack-node", f"{args.env}-ack-node", service_trust("ecs.aliyuncs.com"),
                                           CLUSTER_NODE, "ACK nodes: the node bundle only")
        if args.autoscaler_role:
            # ACK's autoscaler acts through this service role ("ACK adds a new RamRole
            # (AliyunCSManagedAutoScalerRole) for the permission control of the node pool with
            # auto-scaling enabled", pulumi_alicloud cs/node_pool.py; Alibaba's Terraform example
            # "use-case-enable-ack-and-assign-role").
            role = alicloud.ram.Role(f"{name}-ack-autoscaler", role_name=AUTOSCALER_ROLE, description="ACK cluster autoscaler",
                                     assume_role_policy_document=service_trust("cs.aliyuncs.com"), tags=args.tags,
                                     opts=self.child)
            alicloud.ram.RolePolicyAttachment(f"{name}-ack-autoscaler", role_name=role.role_name, policy_type="System",
                                              policy_name="AliyunCSManagedAutoScalerRolePolicy", opts=self.child)
        self.register_outputs({"groups": sorted(self.roles)})

    def role(self, name: str, role_name: str, trust: pulumi.Input[str], grants: Grants,
             description: str) -> alicloud.ram.Role:
        """A RAM role with a policy of the grants in the stack's bucket."""
        args = self.args
        role = alicloud.ram.Role(name, role_name=fit(role_name, "iamRole"), assume_role_policy_document=trust,
                                 description=description, tags=args.tags, opts=self.child)
        policy = alicloud.ram.Policy(f"{name}-bucket", policy_name=fit(f"{role_name}-bucket", "iamRole"),
                                     policy_document=bucket_policy(args.bucket, grants), description=description,
                                     tags=args.tags, opts=self.child)
        alicloud.ram.RolePolicyAttachment(f"{name}-bucket", policy_name=policy.policy_name, policy_type="Custom",
                                          role_name=role.role_name, opts=self.child)
        return role
