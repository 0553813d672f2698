"""The one permission a GPU VM node's RAM role needs to hand itself back after a GPU fault
(cloudinit/scripts/gts-gpu-health.py): ess:SetInstanceHealth on its own scaling group only
(resource acs:ess:{regionId}:{accountId}:scalinggroup/{ScalingGroupId}, the API's RAM
authorization table: help.aliyun.com api-ess-2022-02-22-setinstancehealth)."""

from __future__ import annotations

import json

import pulumi
import pulumi_alicloud as alicloud

from infra.core.names import fit

ACTION = "ess:SetInstanceHealth"


def replace_self_policy(region: str, group_id: str) -> str:
    return json.dumps({"Version": "1", "Statement": [
        {"Effect": "Allow", "Action": ACTION, "Resource": f"acs:ess:{region}:*:scalinggroup/{group_id}"}]})


def grant_replace_self(name: str, role_name: pulumi.Input[str], region: str, group: alicloud.ess.ScalingGroup,
                       tags: dict[str, str], opts: pulumi.ResourceOptions) -> alicloud.ram.RolePolicyAttachment:
    policy = alicloud.ram.Policy(f"{name}-replace-self", policy_name=fit(f"{name}-replace-self", "iamRole"),
                                 policy_document=group.id.apply(lambda i: replace_self_policy(region, i)),
                                 description=f"{name}: a node marks itself unhealthy after a GPU fault", tags=tags,
                                 opts=opts)
    return alicloud.ram.RolePolicyAttachment(f"{name}-replace-self", policy_name=policy.policy_name,
                                             policy_type="Custom", role_name=role_name, opts=opts)
