"""Answers for the provider functions (invokes) the stack program calls, for the mock engine.

Any invoke without an entry here fails the plan loudly, so a new data-source call cannot slip
through with a made-up answer. Values mirror the shape of the real responses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from infra.plan.engine import InvokeHandler


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


INVOKES: dict[str, InvokeHandler] = {
    "aws:ssm/getParameter:getParameter": _aws_ssm_parameter,
    "aws:index/getCallerIdentity:getCallerIdentity": _aws_caller_identity,
    "aws:index/getPartition:getPartition": _aws_partition,
}


# Outputs the real provider computes that the program reads back (mock resources otherwise
# echo their inputs). Keyed by type token.
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


def _asg(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    group = str(inputs.get("name") or f"{name}-20261129000000000000000001")  # AWS names it when unset
    uuid = hashlib.sha256(group.encode()).hexdigest()  # the ARN's shape, as IAM policies name it
    return {"name": group, "arn": f"arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:"
            f"{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:32]}:autoScalingGroupName/{group}"}


COMPUTED: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
    "aws:autoscaling/group:Group": _asg,
    "aws:eks/cluster:Cluster": _eks_cluster,
    "aws:eks/nodeGroup:NodeGroup": _eks_node_group,
    "aws:ec2/launchTemplate:LaunchTemplate": _launch_template,
    "aws:s3/bucket:Bucket": _s3_bucket,
}


def _alicloud_images(args: dict[str, Any]) -> dict[str, Any]:
    image = {"id": "ubuntu_22_04_x64_20G_alibase_20260101.vhd", "name": "ubuntu_22_04_x64_20G_alibase_20260101.vhd",
             "osType": "linux", "architecture": "x86_64", "imageOwnerAlias": "system"}
    return {"id": "images", "ids": [image["id"]], "images": [image], "nameRegex": args.get("nameRegex"),
            "owners": args.get("owners"), "mostRecent": True}


def _alicloud_credential(args: dict[str, Any]) -> dict[str, Any]:
    cid = str(args.get("clusterId"))
    return {"id": cid, "clusterId": cid, "clusterName": cid, "kubeConfig": f"apiVersion: v1\nkind: Config\n# {cid}\n",
            "certificateAuthority": {}}


def _alicloud_vpc(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"routeTableId": f"vtb-{name}", "routerId": f"vrt-{name}"}


def _alicloud_nat(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"snatTableIds": f"stb-{name}", "forwardTableIds": f"ftb-{name}"}


def _alicloud_eip(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"ipAddress": "198.51.100.10"}


INVOKES.update({
    "alicloud:ecs/getImages:getImages": _alicloud_images,
    "alicloud:cs/getClusterCredential:getClusterCredential": _alicloud_credential,
})
COMPUTED.update({
    "alicloud:vpc/network:Network": _alicloud_vpc,
    "alicloud:vpc/natGateway:NatGateway": _alicloud_nat,
    "alicloud:ecs/eipAddress:EipAddress": _alicloud_eip,
})


def _tencent_image(args: dict[str, Any]) -> dict[str, Any]:
    return {"id": "img", "imageId": "img-487zeit5", "imageName": "Ubuntu Server 22.04 LTS 64bit",
            "imageTypes": args.get("imageTypes"), "imageNameRegex": args.get("imageNameRegex")}


def _tencent_user(args: dict[str, Any]) -> dict[str, Any]:
    return {"id": "100000000001", "appId": "1250000000", "ownerUin": "100000000001", "uin": "100000000001"}


def _tencent_cluster(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"kubeConfigIntranet": f"apiVersion: v1\nkind: Config\n# {name}\n", "kubeConfig": ""}


def _tencent_eip(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"publicIp": "203.0.113.20"}


INVOKES.update({
    "tencentcloud:Images/getInstance:getInstance": _tencent_image,
    "tencentcloud:User/getInfo:getInfo": _tencent_user,
})
COMPUTED.update({
    "tencentcloud:Kubernetes/cluster:Cluster": _tencent_cluster,
    "tencentcloud:Eip/instance:Instance": _tencent_eip,
})


# --- generated secrets ---------------------------------------------------------------------------

def _random_password(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """A value of the requested length, stable per name (the real provider draws it once)."""
    length = int(inputs.get("length") or 32)
    return {"result": (hashlib.sha256(name.encode()).hexdigest() * 4)[:length]}


COMPUTED.update({"random:index/randomPassword:RandomPassword": _random_password})


# --- the trainer image and its registries -------------------------------------------------------

def _docker_image(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The digest a push would report: derived from the tags and build inputs, stable per run."""
    import json

    digest = "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    tags = inputs.get("tags") or [name]
    return {"digest": digest, "ref": f"{str(tags[0]).rsplit(':', 1)[0]}@{digest}"}


def _ecr_repository(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"registryId": "123456789012",
            "arn": f"arn:aws:ecr:us-east-1:123456789012:repository/{inputs.get('name', name)}",
            "repositoryUrl": f"123456789012.dkr.ecr.us-east-1.amazonaws.com/{inputs.get('name', name)}"}


def _ecr_token(args: dict[str, Any]) -> dict[str, Any]:
    return {"id": "ecr", "authorizationToken": "QVdTOm1vY2s=", "expiresAt": "2099-01-01T00:00:00Z",
            "proxyEndpoint": "https://123456789012.dkr.ecr.us-east-1.amazonaws.com", "userName": "AWS",
            "password": "mock", "registryId": args.get("registryId")}


def _acr_instances(args: dict[str, Any]) -> dict[str, Any]:
    ids = args.get("ids") or ["acr"]
    name = str(ids[0]).removesuffix("-id")
    return {"id": "acr", "ids": ids, "enableDetails": True, "names": [name], "instances": [{
        "id": ids[0], "name": name, "region": "cn-hangzhou", "specification": "Basic", "namespaceQuota": "3",
        "namespaceUsage": "1", "repoQuota": "1000", "repoUsage": "1", "vpcEndpoints": [f"{name}-registry-vpc.cn-hangzhou.cr.aliyuncs.com"],
        "publicEndpoints": [f"{name}-registry.cn-hangzhou.cr.aliyuncs.com"], "authorizationToken": "mock",
        "tempUsername": "cr_temp_user"}]}


def _tcr_instance(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"publicDomain": f"{inputs.get('name', name)}.tencentcloudcr.com",
            "internalEndPoint": "10.70.0.100"}


def _tcr_token(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"userName": "100000000001", "token": "mock", "tokenId": f"{name}-tok"}


def _ack_cluster(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"rrsaMetadata": {"enabled": True, "ramOidcProviderArn": f"acs:ram::100000000001:oidc-provider/ack-rrsa-{name}",
                             "ramOidcProviderName": f"ack-rrsa-{name}",
                             "rrsaOidcIssuerUrl": f"https://oidc-ack-cn-hangzhou.oss-cn-hangzhou.aliyuncs.com/{name}"}}


def _ram_role(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"arn": f"acs:ram::100000000001:role/{inputs.get('roleName', name)}"}


def _tke_endpoint(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"kubeConfig": f"apiVersion: v1\nkind: Config\n# {name} public\n",
            "kubeConfigIntranet": f"apiVersion: v1\nkind: Config\n# {name} intranet\n"}


INVOKES.update({
    "aws:ecr/getAuthorizationToken:getAuthorizationToken": _ecr_token,
    "alicloud:cs/getRegistryEnterpriseInstances:getRegistryEnterpriseInstances": _acr_instances,
})
COMPUTED.update({
    "docker-build:index:Image": _docker_image,
    "aws:ecr/repository:Repository": _ecr_repository,
    "tencentcloud:Tcr/instance:Instance": _tcr_instance,
    "tencentcloud:Tcr/token:Token": _tcr_token,
    "alicloud:cs/managedKubernetes:ManagedKubernetes": _ack_cluster,
    "alicloud:ram/role:Role": _ram_role,
    "tencentcloud:Kubernetes/clusterEndpoint:ClusterEndpoint": _tke_endpoint,
})


# --- shared file systems (infra/clouds/<cloud>/sharedfs.py): the addresses nodes mount ----------
def _mock_id(prefix: str, name: str, length: int = 8) -> str:
    return prefix + hashlib.sha256(name.encode()).hexdigest()[:length]


def _efs(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    fs_id = _mock_id("fs-", name, 17)
    return {"id": fs_id, "dnsName": f"{fs_id}.efs.mock-region.amazonaws.com",
            "arn": f"arn:aws:elasticfilesystem:us-east-1:123456789012:file-system/{fs_id}"}


def _lustre(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    fs_id = _mock_id("fs-", name, 17)
    return {"id": fs_id, "dnsName": f"{fs_id}.fsx.mock-region.amazonaws.com", "mountName": _mock_id("", name)}


def _nas_mount_target(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"mountTargetDomain": f"{_mock_id('', name, 10)}-abc12.mock-region.nas.aliyuncs.com"}


def _cfs(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"id": _mock_id("cfs-", name), "fsId": _mock_id("", name), "mountIp": "10.70.0.27"}


COMPUTED.update({
    "aws:efs/fileSystem:FileSystem": _efs,
    "aws:fsx/lustreFileSystem:LustreFileSystem": _lustre,
    "alicloud:nas/mountTarget:MountTarget": _nas_mount_target,
    "tencentcloud:Cfs/fileSystem:FileSystem": _cfs,
})


# --- ARNs and ids that IAM documents and mounts name (issue 27: the plan's policies are linted
# by parliament, which refuses the engine's generic mock ARN; an EFS volume handle is fs-…::fsap-…)

def _aws_id(name: str, prefix: str) -> str:
    return f"{prefix}-{hashlib.sha256(name.encode()).hexdigest()[:17]}"


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


def _placement_group(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"name": str(inputs.get("name") or f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:7]}")}  # auto-named


COMPUTED.update({
    "aws:ec2/placementGroup:PlacementGroup": _placement_group,
    "aws:kms/key:Key": _kms_key,
    "aws:iam/role:Role": _iam_role,
    "aws:efs/accessPoint:AccessPoint": _efs_access_point,
})
