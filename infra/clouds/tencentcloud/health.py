"""The one permission a GPU VM node's CAM role needs to hand itself back after a GPU fault
(cloudinit/scripts/gts-gpu-health.py): as:RemoveInstances on its own scaling group only
(resource qcs::as:{region}:uin/*:autoscalinggroup/{id}; CAM's resource description format,
cloud.tencent.com/document/product/598/10606 — the AS resource-level support is unverified)."""

from __future__ import annotations

import json

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

ACTION = "as:RemoveInstances"


def replace_self_policy(region: str, group_id: str) -> str:
    return json.dumps({"version": "2.0", "statement": [
        {"effect": "allow", "action": [ACTION], "resource": [f"qcs::as:{region}:uin/*:autoscalinggroup/{group_id}"]}]})


def grant_replace_self(name: str, role_id: pulumi.Input[str], region: str, group: tencentcloud.as_.ScalingGroup,
                       opts: pulumi.ResourceOptions) -> tencentcloud.cam.RolePolicyAttachment:
    policy = tencentcloud.cam.Policy(f"{name}-replace-self", name=f"{name}-replace-self",
                                     document=group.id.apply(lambda i: replace_self_policy(region, i)),
                                     description=f"{name}: a node removes itself after a GPU fault", opts=opts)
    return tencentcloud.cam.RolePolicyAttachment(f"{name}-replace-self", role_id=role_id, policy_id=policy.id, opts=opts)
