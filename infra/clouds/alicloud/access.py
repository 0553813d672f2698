"""Alibaba Cloud RAM: the node role, allowed only its bucket's prefixes."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud


def bucket_policy(bucket: str, prefixes: list[str]) -> str:
    return json.dumps({"Version": "1", "Statement": [
        {"Effect": "Allow", "Action": ["oss:ListObjects"], "Resource": [f"acs:oss:*:*:{bucket}"],
         "Condition": {"StringLike": {"oss:Prefix": [f"{p}*" for p in prefixes]}}},
        {"Effect": "Allow", "Action": ["oss:GetObject", "oss:PutObject", "oss:DeleteObject",
                                       "oss:AbortMultipartUpload", "oss:ListParts"],
         "Resource": [f"acs:oss:*:*:{bucket}/{p}*" for p in prefixes]},
    ]})


AUTOSCALER_ROLE = "AliyunCSManagedAutoScalerRole"  # the name ACK looks for


@dataclass
class AlicloudAccessArgs:
    bucket: str
    prefixes: list[str]
    tags: dict[str, str]
    autoscaler_role: bool  # create ACK's account-wide autoscaler role (one stack per account)


class AlicloudAccess(pulumi.ComponentResource):
    role: alicloud.ram.Role

    def __init__(self, name: str, args: AlicloudAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Access", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = alicloud.ram.Role(
            f"{name}-node", role_name=f"{name}-node",
            assume_role_policy_document=json.dumps({"Version": "1", "Statement": [{
                "Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Service": ["ecs.aliyuncs.com"]}}]}),
            description="GPU training nodes: own bucket prefixes", tags=args.tags, opts=child)
        policy = alicloud.ram.Policy(f"{name}-node-bucket", policy_name=f"{name}-node-bucket",
                                     policy_document=bucket_policy(args.bucket, args.prefixes),
                                     description="read datasets, read/write checkpoints", tags=args.tags, opts=child)
        alicloud.ram.RolePolicyAttachment(f"{name}-node-bucket", policy_name=policy.policy_name, policy_type="Custom",
                                          role_name=self.role.role_name, opts=child)
        if args.autoscaler_role:
            # ACK's autoscaler acts through this service role ("ACK adds a new RamRole
            # (AliyunCSManagedAutoScalerRole) for the permission control of the node pool with
            # auto-scaling enabled", pulumi_alicloud cs/node_pool.py; Alibaba's Terraform example
            # "use-case-enable-ack-and-assign-role").
            role = alicloud.ram.Role(
                f"{name}-ack-autoscaler", role_name=AUTOSCALER_ROLE, description="ACK cluster autoscaler", tags=args.tags,
                assume_role_policy_document=json.dumps({"Version": "1", "Statement": [{
                    "Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Service": ["cs.aliyuncs.com"]}}]}),
                opts=child)
            alicloud.ram.RolePolicyAttachment(f"{name}-ack-autoscaler", role_name=role.role_name, policy_type="System",
                                              policy_name="AliyunCSManagedAutoScalerRolePolicy", opts=child)
        self.register_outputs({"roleName": self.role.role_name})
