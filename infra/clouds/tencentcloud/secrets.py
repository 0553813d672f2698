"""Tencent Cloud: a multi-node VM group's rendezvous key in Secrets Manager (SSM), out of the
user data.

A secret `gts-<env>-<group>-rdzv-key` with one version (`v1`; tencentcloud ssm.Secret and
ssm.SecretVersion, the provider's default KMS key). The group's CAM role may read that one
secret: `name/ssm:GetSecretValue` on `qcs::ssm:<region>:uin/<owner uin>:secret/creatorUin/<creator
uin>/<name>` (SSM's CAM page, cloud.tencent.com/document/product/1078/38612; the creator is who
runs `pulumi up`, `uin` of the provider's account info). The node fetches it at boot
(infra/clouds/tencentcloud/node.py rendezvous_key: GetSecretValue, 2019-09-23, TC3-signed with
the instance role) into a 0600 file the trainer container reads."""

from __future__ import annotations

import json

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

VERSION = "v1"


def key_name(env: str, group: str) -> str:
    return f"gts-{env}-{group}-rdzv-key"


def read_policy(region: str, owner_uin: str, creator_uin: str, name: str) -> str:
    return json.dumps({"version": "2.0", "statement": [
        {"effect": "allow", "action": ["name/ssm:GetSecretValue"],
         "resource": [f"qcs::ssm:{region}:uin/{owner_uin}:secret/creatorUin/{creator_uin}/{name}"]}]})


def rendezvous_key(env: str, group: str, region: str, key: pulumi.Input[str], role_id: pulumi.Input[str],
                   tags: dict[str, str], opts: pulumi.ResourceOptions) -> str:
    """The secret holding the group's key, readable by its node role alone; its name."""
    name = key_name(env, group)
    secret = tencentcloud.ssm.Secret(f"{group}-rdzv-key", secret_name=name, description=f"rendezvous key of {group}",
                                     is_enabled=True, recovery_window_in_days=0, tags=tags, opts=opts)
    # The provider does not mark secret_string secret: the stack does.
    tencentcloud.ssm.SecretVersion(f"{group}-rdzv-key", secret_name=secret.secret_name, version_id=VERSION,
                                   secret_string=pulumi.Output.secret(key), opts=opts)
    account = tencentcloud.user.get_info_output(opts=pulumi.InvokeOutputOptions(provider=opts.provider,
                                                                                 parent=opts.parent))
    document = pulumi.Output.all(account.owner_uin, account.uin).apply(
        lambda got: read_policy(region, str(got[0]), str(got[1]), name))
    policy = tencentcloud.cam.Policy(f"{group}-rdzv-key", name=f"{env}-{group}-rdzv-key", document=document,
                                     description=f"{group}: its nodes read the group's rendezvous key", opts=opts)
    tencentcloud.cam.RolePolicyAttachment(f"{group}-rdzv-key", role_id=role_id, policy_id=policy.id, opts=opts)
    return name
