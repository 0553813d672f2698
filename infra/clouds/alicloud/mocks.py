"""Alibaba Cloud's answers for the mock engine (`make plan`, the tests): the invokes the stack
calls and the outputs the real provider computes that the program reads back. Values mirror the
shape of the real responses. infra/plan/invokes.py gathers every cloud's through the registry."""

from __future__ import annotations

from typing import Any

from infra.plan.mockids import mock_id as _mock_id


def _alicloud_images(args: dict[str, Any]) -> dict[str, Any]:
    image = {"id": "ubuntu_22_04_x64_20G_alibase_20260101.vhd", "name": "ubuntu_22_04_x64_20G_alibase_20260101.vhd",
             "osType": "linux", "architecture": "x86_64", "imageOwnerAlias": "system"}
    return {"id": "images", "ids": [image["id"]], "images": [image], "nameRegex": args.get("nameRegex"),
            "owners": args.get("owners"), "mostRecent": True}


def _alicloud_credential(args: dict[str, Any]) -> dict[str, Any]:
    cid = str(args.get("clusterId"))
    return {"id": cid, "clusterId": cid, "clusterName": cid, "kubeConfig": f"apiVersion: v1\nkind: Config\n# {cid}\n",
            "certificateAuthority": {}}


def _acr_instances(args: dict[str, Any]) -> dict[str, Any]:
    ids = args.get("ids") or ["acr"]
    name = str(ids[0]).removesuffix("-id")
    return {"id": "acr", "ids": ids, "enableDetails": True, "names": [name], "instances": [{
        "id": ids[0], "name": name, "region": "cn-hangzhou", "specification": "Basic", "namespaceQuota": "3",
        "namespaceUsage": "1", "repoQuota": "1000", "repoUsage": "1", "vpcEndpoints": [f"{name}-registry-vpc.cn-hangzhou.cr.aliyuncs.com"],
        "publicEndpoints": [f"{name}-registry.cn-hangzhou.cr.aliyuncs.com"], "authorizationToken": "mock",
        "tempUsername": "cr_temp_user"}]}


def _alicloud_vpc(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"routeTableId": f"vtb-{name}", "routerId": f"vrt-{name}"}


def _alicloud_nat(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"snatTableIds": f"stb-{name}", "forwardTableIds": f"ftb-{name}"}


def _alicloud_eip(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"ipAddress": "198.51.100.10"}


def _ack_cluster(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"rrsaMetadata": {"enabled": True, "ramOidcProviderArn": f"acs:ram::100000000001:oidc-provider/ack-rrsa-{name}",
                             "ramOidcProviderName": f"ack-rrsa-{name}",
                             "rrsaOidcIssuerUrl": f"https://oidc-ack-cn-hangzhou.oss-cn-hangzhou.aliyuncs.com/{name}"}}


def _ram_role(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"arn": f"acs:ram::100000000001:role/{inputs.get('roleName', name)}"}


def _nas_mount_target(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"mountTargetDomain": f"{_mock_id('', name, 10)}-abc12.mock-region.nas.aliyuncs.com"}


INVOKES = {
    "alicloud:ecs/getImages:getImages": _alicloud_images,
    "alicloud:cs/getClusterCredential:getClusterCredential": _alicloud_credential,
    "alicloud:cs/getRegistryEnterpriseInstances:getRegistryEnterpriseInstances": _acr_instances,
}
COMPUTED = {
    "alicloud:vpc/network:Network": _alicloud_vpc,
    "alicloud:vpc/natGateway:NatGateway": _alicloud_nat,
    "alicloud:ecs/eipAddress:EipAddress": _alicloud_eip,
    "alicloud:cs/managedKubernetes:ManagedKubernetes": _ack_cluster,
    "alicloud:ram/role:Role": _ram_role,
    "alicloud:nas/mountTarget:MountTarget": _nas_mount_target,
}
