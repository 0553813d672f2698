"""The one permission a GPU VM node's role needs to hand itself back after a GPU fault
(cloudinit/scripts/gts-gpu-health.py): autoscaling:SetInstanceHealth on its own group only. Its
own policy, apart from the role's others (infra/clouds/aws/access.py)."""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws

ACTION = "autoscaling:SetInstanceHealth"


def replace_self_policy(group_arn: str) -> str:
    """SetInstanceHealth supports resource-level permissions on the autoScalingGroup ARN (Service
    Authorization Reference, "Actions defined by Amazon EC2 Auto Scaling")."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "ReplaceSelfAfterGpuFault", "Effect": "Allow", "Action": ACTION, "Resource": group_arn}]})


def grant_replace_self(name: str, role: pulumi.Input[str], group: aws.autoscaling.Group,
                       opts: pulumi.ResourceOptions) -> aws.iam.RolePolicy:
    return aws.iam.RolePolicy(f"{name}-replace-self", role=role, policy=group.arn.apply(replace_self_policy), opts=opts)
