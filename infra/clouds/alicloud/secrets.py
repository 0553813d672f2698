"""Alibaba Cloud: a multi-node VM group's rendezvous key as an OOS encrypted parameter, out of
the user data.

An encrypted ("Secret") parameter of CloudOps Orchestration Service (`gts/<env>/<group>/rdzv-key`,
pulumi_alicloud oos.SecretParameter), encrypted by KMS with the service's default key: no paid
KMS instance, which KMS 3.0's own secrets need. The group's RAM role may read that one parameter:
`oos:GetSecretParameter` on `acs:oos:<region>:*:secretparameter/<name>` (the API's RAM table,
help.aliyun.com api-oos-2019-06-01-getsecretparameter) with `kms:GetSecretValue` beside it, as
OOS's "Control access to different encryption parameters from a RAM user" (doc 200116) grants
it: the API asks for KMS's GetSecretValue permission too. The node fetches it at boot
(infra/clouds/alicloud/node.py rendezvous_key) into a 0600 file the trainer container reads.
Unverified without an account: that the KMS action is evaluated against the parameter's
resource as the OOS page's example writes it."""

from __future__ import annotations

import json

import pulumi
import pulumi_alicloud as alicloud

from infra.core.names import fit


def key_name(env: str, group: str) -> str:
    return f"gts/{env}/{group}/rdzv-key"


def read_policy(region: str, name: str) -> str:
    return json.dumps({"Version": "1", "Statement": [
        {"Effect": "Allow", "Action": ["oos:GetSecretParameter", "kms:GetSecretValue"],
         "Resource": [f"acs:oos:{region}:*:secretparameter/{name}"]}]})


def rendezvous_key(env: str, group: str, region: str, key: pulumi.Input[str], role_name: pulumi.Input[str],
                   tags: dict[str, str], opts: pulumi.ResourceOptions) -> str:
    """The parameter holding the group's key, readable by its node role alone; its name."""
    name = key_name(env, group)
    alicloud.oos.SecretParameter(f"{group}-rdzv-key", secret_parameter_name=name, type="Secret",
                                 value=pulumi.Output.secret(key), description=f"rendezvous key of {group}",
                                 tags=tags, opts=opts)
    policy = alicloud.ram.Policy(f"{group}-rdzv-key", policy_name=fit(f"{env}-{group}-rdzv-key", "iamRole"),
                                 policy_document=read_policy(region, name),
                                 description=f"{group}: its nodes read the group's rendezvous key", tags=tags, opts=opts)
    alicloud.ram.RolePolicyAttachment(f"{group}-rdzv-key", policy_name=policy.policy_name, policy_type="Custom",
                                      role_name=role_name, opts=opts)
    return name
