"""AWS's answers for the mock engine (`make plan`, the tests): the invokes the stack
calls and the outputs the real provider computes that the program reads back. Values mirror the
shape of the real responses. infra/plan/invokes.py gathers every cloud's through the registry."""

from __future__ import annotations

import hashlib
from typing import Any

from infra.plan.mockids import mock_id as _mock_id


def _aws_id(name: str, prefix: str) -> str:
    return f"{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:17]}"


def _aws_ssm_parameter(args: dict[str, Any]) -> dict[str, Any]:
    name = str(args["name"])
    return {"id": name, "name": name, "type": "String", "value": "ami-0123456789abcdef0",
            "insecureValue": "ami-0123456789abcdef0", "arn": f"arn:aws:ssm:::parameter{name}",
            "version": 1, "withDecryption": True}


def _aws_caller_identity(args: dict[str, Any]) -> dict[str, Any]:
    return {"accountId": "123456789012", "arn": "arn:aws:iam::123456789012:user/plan",
            "id": "123456789012", "userId": "AIDAPLAN"}


def _aws_partition(args: dict[str, Any]) -> dict[str, Any]:
    return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws",
            "reverseDnsPrefix": "com.amazonaws"}


def _ecr_token(args: dict[str, Any]) -> dict[str, Any]:
    return {"id": "ecr", "authorizationToken": "QVdTOm1vY2s=", "expiresAt": "2099-01-01T00:00:00Z",
            "proxyEndpoint": "https://123456789012.dkr.ecr.us-east-1.amazonaws.com", "userName": "AWS",
            "password": "mock", "registryId": args.get("registryId")}


def _asg(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    group = str(inputs.get("name") or f"{name}-20261129000000000000000001")  # AWS names it when unset
    uuid = hashlib.sha256(group.encode()).hexdigest()  # the ARN's shape, as IAM policies name it
    return {"name": group, "arn": f"arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:"
            f"{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:32]}:autoScalingGroupName/{group}"}


def _eks_cluster(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"endpoint": f"https://{name}.gr7.mock.eks.amazonaws.com",
            "certificateAuthority": {"data": "TU9DSy1DQQ=="}, "name": inputs.get("name", name)}


def _eks_node_group(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"resources": [{"autoscalingGroups": [{"name": f"eks-{name}-asg"}]}]}


def _launch_template(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"latestVersion": 1}


def _s3_bucket(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    bucket = inputs.get("bucket", name)
    return {"id": bucket, "bucket": bucket, "arn": f"arn:aws:s3:::{bucket}"}


def _ecr_repository(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"registryId": "123456789012",
            "arn": f"arn:aws:ecr:us-east-1:123456789012:repository/{inputs.get('name', name)}",
            "repositoryUrl": f"123456789012.dkr.ecr.us-east-1.amazonaws.com/{inputs.get('name', name)}"}


def _efs(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    fs_id = _mock_id("fs-", name, 17)
    return {"id": fs_id, "dnsName": f"{fs_id}.efs.mock-region.amazonaws.com",
            "arn": f"arn:aws:elasticfilesystem:us-east-1:123456789012:file-system/{fs_id}"}


def _lustre(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    fs_id = _mock_id("fs-", name, 17)
    return {"id": fs_id, "dnsName": f"{fs_id}.fsx.mock-region.amazonaws.com", "mountName": _mock_id("", name)}


def _placement_group(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"name": str(inputs.get("name") or f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:7]}")}  # auto-named


def _kms_key(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    key_id = hashlib.sha256(name.encode()).hexdigest()
    uuid = f"{key_id[:8]}-{key_id[8:12]}-{key_id[12:16]}-{key_id[16:20]}-{key_id[20:32]}"
    return {"id": uuid, "keyId": uuid, "arn": f"arn:aws:kms:us-east-1:123456789012:key/{uuid}"}


def _iam_role(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    role = str(inputs.get("name") or name)
    return {"id": role, "name": role, "arn": f"arn:aws:iam::123456789012:role/{role}"}


def _efs_access_point(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    ap_id = _aws_id(name, "fsap")
    return {"id": ap_id, "arn": f"arn:aws:elasticfilesystem:us-east-1:123456789012:access-point/{ap_id}"}


def _ssm_parameter(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    # arn:aws:ssm:<region>:<account>:parameter/<name without its leading slash> (SSM's ARN format)
    path = str(inputs.get("name") or name).lstrip("/")
    return {"id": f"/{path}", "arn": f"arn:aws:ssm:us-east-1:123456789012:parameter/{path}"}


INVOKES = {
    "aws:ssm/getParameter:getParameter": _aws_ssm_parameter,
    "aws:index/getCallerIdentity:getCallerIdentity": _aws_caller_identity,
    "aws:index/getPartition:getPartition": _aws_partition,
    "aws:ecr/getAuthorizationToken:getAuthorizationToken": _ecr_token,
}
COMPUTED = {
    "aws:autoscaling/group:Group": _asg,
    "aws:eks/cluster:Cluster": _eks_cluster,
    "aws:eks/nodeGroup:NodeGroup": _eks_node_group,
    "aws:ec2/launchTemplate:LaunchTemplate": _launch_template,
    "aws:s3/bucket:Bucket": _s3_bucket,
    "aws:ecr/repository:Repository": _ecr_repository,
    "aws:efs/fileSystem:FileSystem": _efs,
    "aws:fsx/lustreFileSystem:LustreFileSystem": _lustre,
    "aws:ec2/placementGroup:PlacementGroup": _placement_group,
    "aws:kms/key:Key": _kms_key,
    "aws:iam/role:Role": _iam_role,
    "aws:efs/accessPoint:AccessPoint": _efs_access_point,
    "aws:ssm/parameter:Parameter": _ssm_parameter,
}
