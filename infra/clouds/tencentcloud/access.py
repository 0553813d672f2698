"""Tencent Cloud CAM: the node role, allowed only its bucket's prefixes."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud


def bucket_policy(bucket: str, region: str, app_id: str, prefixes: list[str]) -> str:
    resource = f"qcs::cos:{region}:uid/{app_id}:{bucket}"
    return json.dumps({"version": "2.0", "statement": [
        {"effect": "allow", "action": ["name/cos:GetBucket"], "resource": [f"{resource}/"]},
        {"effect": "allow", "action": ["name/cos:GetObject", "name/cos:PutObject", "name/cos:DeleteObject",
                                       "name/cos:HeadObject", "name/cos:InitiateMultipartUpload",
                                       "name/cos:UploadPart", "name/cos:CompleteMultipartUpload",
                                       "name/cos:AbortMultipartUpload", "name/cos:ListParts"],
         "resource": [f"{resource}/{p}*" for p in prefixes]},
    ]})


@dataclass
class TencentAccessArgs:
    bucket: str
    region: str
    app_id: str
    prefixes: list[str]
    tags: dict[str, str]


class TencentAccess(pulumi.ComponentResource):
    role: tencentcloud.cam.Role

    def __init__(self, name: str, args: TencentAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Access", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.role = tencentcloud.cam.Role(
            f"{name}-node", name=f"{name}-node", console_login=False,
            document=json.dumps({"version": "2.0", "statement": [{
                "action": ["name/sts:AssumeRole"], "effect": "allow",
                "principal": {"service": ["cvm.qcloud.com"]}}]}),
            description="GPU training nodes: own bucket prefixes", tags=args.tags, opts=child)
        policy = tencentcloud.cam.Policy(f"{name}-node-bucket", name=f"{name}-node-bucket",
                                         document=bucket_policy(args.bucket, args.region, args.app_id, args.prefixes),
                                         description="read datasets, read/write checkpoints", opts=child)
        tencentcloud.cam.RolePolicyAttachment(f"{name}-node-bucket", role_id=self.role.id, policy_id=policy.id,
                                              opts=child)
        self.register_outputs({"roleName": self.role.name})
