"""Tencent Cloud CAM: one role per node group (VM fleets and TKE pools alike), limited to that
group's grants in the bucket (infra/resolve/access.py), and one per TKE training group's pods (`pod_role`,
TKE pod identity: infra/clouds/tencentcloud/kubernetes.py), whose trust names the cluster's OIDC
provider and the Job's service account alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.core.names import fit
from infra.resolve.access import Grants

COS_READ = ["name/cos:GetObject", "name/cos:HeadObject"]
COS_WRITE = ["name/cos:PutObject", "name/cos:DeleteObject", "name/cos:InitiateMultipartUpload", "name/cos:UploadPart",
             "name/cos:CompleteMultipartUpload", "name/cos:AbortMultipartUpload", "name/cos:ListParts"]


def bucket_policy(bucket: str, region: str, app_id: str, grants: Grants) -> str:
    resource = f"qcs::cos:{region}:uid/{app_id}:{bucket}"
    statements: list[dict[str, object]] = [
        # Listing under a prefix: the bucket's objects as the resource, the prefix as a condition
        # (COS "Granting a sub-account access to a specific directory", cloud.tencent.com/document/product/436/46206).
        # GetBucketObjectVersions: the replacement budget's slots on this versioned bucket go to
        # their oldest version's writer (training/node/replace_budget.py; COS API 436/35521).
        {"effect": "allow", "action": ["name/cos:GetBucket", "name/cos:GetBucketObjectVersions"], "resource": [f"{resource}/*"],
         "condition": {"string_like": {"cos:prefix": [f"{p}*" for p in grants.prefixes]}}},
        {"effect": "allow", "action": COS_READ, "resource": [f"{resource}/{p}*" for p in grants.prefixes]}]
    if grants.writes:
        statements.append({"effect": "allow", "action": COS_WRITE, "resource": [f"{resource}/{p}*" for p in grants.writes]})
    return json.dumps({"version": "2.0", "statement": statements})


@dataclass
class TencentAccessArgs:
    bucket: str
    region: str
    app_id: str
    env: str
    tags: dict[str, str]
    groups: dict[str, Grants] = field(default_factory=dict)  # every node group of this cloud


class TencentAccess(pulumi.ComponentResource):
    roles: dict[str, tencentcloud.cam.Role]

    def __init__(self, name: str, args: TencentAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Access", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.args, self.child = args, child
        self.roles = {}
        for group, grants in args.groups.items():
            self.roles[group] = self.role(
                f"{name}-{group}", f"{args.env}-{group}-node",
                json.dumps({"version": "2.0", "statement": [{
                    "action": ["name/sts:AssumeRole"], "effect": "allow", "principal": {"service": ["cvm.qcloud.com"]}}]}),
                grants, f"GPU nodes of {group}: its dataset, its own checkpoints",
                f"{group}: its dataset, its own checkpoints")
        self.register_outputs({"groups": sorted(self.roles)})

    def role(self, name: str, role_name: str, trust: pulumi.Input[str], grants: Grants, description: str,
             policy_description: str | None = None, after: list[pulumi.Resource] | None = None) -> tencentcloud.cam.Role:
        """A CAM role trusted as `trust` says (the CVM service for nodes; a cluster's OIDC provider
        for pods, made after `after`), with a policy of its grants in the stack's bucket."""
        args = self.args
        role_name = fit(role_name, "iamRole")
        role = tencentcloud.cam.Role(name, name=role_name, console_login=False, document=trust,
                                     description=description, tags=args.tags, opts=pulumi.ResourceOptions.merge(
                                         self.child, pulumi.ResourceOptions(depends_on=after or [])))
        policy = tencentcloud.cam.Policy(f"{name}-bucket", name=f"{role_name}-bucket",
                                         document=bucket_policy(args.bucket, args.region, args.app_id, grants),
                                         description=policy_description or description, opts=self.child)
        tencentcloud.cam.RolePolicyAttachment(f"{name}-bucket", role_id=role.id, policy_id=policy.id, opts=self.child)
        return role
