"""Tencent Cloud's answers for the mock engine (`make plan`, the tests): the invokes the stack
calls and the outputs the real provider computes that the program reads back. Values mirror the
shape of the real responses. infra/plan/invokes.py gathers every cloud's through the registry."""

from __future__ import annotations

from typing import Any

from infra.plan.mockids import mock_id as _mock_id


def _tencent_image(args: dict[str, Any]) -> dict[str, Any]:
    return {"id": "img", "imageId": "img-487zeit5", "imageName": "Ubuntu Server 22.04 LTS 64bit",
            "imageTypes": args.get("imageTypes"), "imageNameRegex": args.get("imageNameRegex")}


def _tencent_user(args: dict[str, Any]) -> dict[str, Any]:
    return {"id": "100000000001", "appId": "1250000000", "ownerUin": "100000000001", "uin": "100000000001"}


def _tencent_cluster(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"kubeConfigIntranet": f"apiVersion: v1\nkind: Config\n# {name}\n", "kubeConfig": ""}


def _tencent_eip(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"publicIp": "203.0.113.20"}


def _tcr_instance(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"publicDomain": f"{inputs.get('name', name)}.tencentcloudcr.com",
            "internalEndPoint": "10.70.0.100"}


def _tcr_token(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"userName": "100000000001", "token": "mock", "tokenId": f"{name}-tok"}


def _tke_endpoint(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"kubeConfig": f"apiVersion: v1\nkind: Config\n# {name} public\n",
            "kubeConfigIntranet": f"apiVersion: v1\nkind: Config\n# {name} intranet\n"}


def _cfs(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    return {"id": _mock_id("cfs-", name), "fsId": _mock_id("", name), "mountIp": "10.70.0.27"}


INVOKES = {
    "tencentcloud:Images/getInstance:getInstance": _tencent_image,
    "tencentcloud:User/getInfo:getInfo": _tencent_user,
}
COMPUTED = {
    "tencentcloud:Kubernetes/cluster:Cluster": _tencent_cluster,
    "tencentcloud:Eip/instance:Instance": _tencent_eip,
    "tencentcloud:Tcr/instance:Instance": _tcr_instance,
    "tencentcloud:Tcr/token:Token": _tcr_token,
    "tencentcloud:Kubernetes/clusterEndpoint:ClusterEndpoint": _tke_endpoint,
    "tencentcloud:Cfs/fileSystem:FileSystem": _cfs,
}
