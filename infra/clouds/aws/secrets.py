"""AWS: a multi-node VM group's rendezvous key in SSM Parameter Store, out of the user data.

A SecureString parameter in the group's region (`/gts/<env>/<group>/rdzv-key`), encrypted with
the account's `aws/ssm` key (SSM "Restricting access to Parameter Store parameters using IAM
policies": that key lets every principal of the account decrypt, so who reads the key is decided
by `ssm:GetParameter` on the parameter's ARN alone). The group's node role may read that one
parameter; the node fetches it at boot (`cloudmeta.py rdzv-key`, infra/clouds/aws/node.py
rendezvous_key: GetParameter WithDecryption, signed by the instance role) into a 0600 file the
trainer container reads. Its value never appears in the user data, so
ec2:DescribeLaunchTemplateVersions reveals nothing."""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws


def key_name(env: str, group: str) -> str:
    return f"/gts/{env}/{group}/rdzv-key"


def read_policy(parameter_arn: str) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": parameter_arn}]})


def rendezvous_key(env: str, group: str, key: pulumi.Input[str], role: pulumi.Input[str], tags: dict[str, str],
                   opts: pulumi.ResourceOptions) -> str:
    """The parameter holding the group's key, readable by its node role alone; its name."""
    name = key_name(env, group)
    parameter = aws.ssm.Parameter(f"{group}-rdzv-key", name=name, type="SecureString",
                                  value=pulumi.Output.secret(key), description=f"rendezvous key of {group}",
                                  tags=tags, opts=opts)
    aws.iam.RolePolicy(f"{group}-rdzv-key", role=role, policy=parameter.arn.apply(read_policy), opts=opts)
    return name
