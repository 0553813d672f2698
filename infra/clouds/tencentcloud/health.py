"""What a Tencent GPU VM node needs to hand itself back after a GPU fault
(cloudinit/scripts/gts-gpu-health.py), on its own scaling group only: resource
qcs::as:{region}:uin/{owner uin}:auto-scaling-group/{id}, actions name/as:… (Auto Scaling's CAM
page, intl.cloud.tencent.com/document/product/377/34548, lists RemoveInstances,
ModifyDesiredCapacity and DescribeAutoScalingGroups as resource-level on
`auto-scaling-group/<id>`; CAM's resource description format and its `uin/<uin>` account
segment, cloud.tencent.com/document/product/598/10606; actions are "described using the prefix
name", 598/10603). No CAM condition names the calling instance (the AS table lists tag
authorization and qcs:ip only), so the grant covers the node's own group, not the node alone.

- as:RemoveInstances, the call that takes the node out ("instances created by AS are terminated",
  cloud.tencent.com/document/api/377/20431);
- as:DescribeAutoScalingGroups and as:ModifyDesiredCapacity, to read the desired capacity
  before and set it back after: RemoveInstances' documentation does not say whether it lowers
  it (ScaleInInstances, 377/40718, and EnterStandby say they do), so the node keeps it.

And the group's id, which the node cannot learn at run time: Tencent's metadata service has no
scaling-group entry (cloud.tencent.com/document/product/213/4934 lists instance, placement,
network and CAM entries), and user data is rendered before the group exists. The plan writes it
to nodes/scaling-groups/<group> in the stack's bucket, which the node's role reads already (the
node bundle's prefix, infra/resolve/access.py): no new permission."""

from __future__ import annotations

import json

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.buckets import NODES_PREFIX

ACTIONS = ("name/as:DescribeAutoScalingGroups", "name/as:RemoveInstances", "name/as:ModifyDesiredCapacity")


def group_id_key(group: str) -> str:
    """The object holding a group's scaling-group id (the node reads the same key: infra/clouds/tencentcloud/node.py)."""
    return f"{NODES_PREFIX}scaling-groups/{group}"


def group_resource(region: str, owner_uin: str, group_id: str) -> str:
    """A scaling group as CAM names it (377/34548: `qcs::as:$region:$account:auto-scaling-group/$id`)."""
    return f"qcs::as:{region}:uin/{owner_uin}:auto-scaling-group/{group_id}"


def replace_self_policy(region: str, owner_uin: str, group_id: str) -> str:
    return json.dumps({"version": "2.0", "statement": [
        {"effect": "allow", "action": list(ACTIONS), "resource": [group_resource(region, owner_uin, group_id)]}]})


def grant_replace_self(name: str, role_id: pulumi.Input[str], region: str, group: tencentcloud.as_.ScalingGroup,
                       opts: pulumi.ResourceOptions) -> tencentcloud.cam.RolePolicyAttachment:
    owner = tencentcloud.user.get_info_output(opts=pulumi.InvokeOutputOptions(
        provider=opts.provider, parent=opts.parent)).owner_uin
    document = pulumi.Output.all(owner, group.id).apply(lambda got: replace_self_policy(region, str(got[0]), str(got[1])))
    policy = tencentcloud.cam.Policy(f"{name}-replace-self", name=f"{name}-replace-self", document=document,
                                     description=f"{name}: a node removes itself after a GPU fault", opts=opts)
    return tencentcloud.cam.RolePolicyAttachment(f"{name}-replace-self", role_id=role_id, policy_id=policy.id, opts=opts)


def publish_group_id(name: str, group_name: str, bucket: pulumi.Input[str], group: tencentcloud.as_.ScalingGroup,
                     tags: dict[str, str], opts: pulumi.ResourceOptions) -> tencentcloud.cos.BucketObject:
    """The scaling group's id where the group's nodes read it (created once the group exists)."""
    return tencentcloud.cos.BucketObject(f"{name}-group-id", bucket=bucket, key=group_id_key(group_name),
                                         content=group.id, content_type="text/plain", tags=tags, opts=opts)
