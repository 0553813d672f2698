"""Tencent Cloud's answers to infra/clouds/profile.py."""

from __future__ import annotations

import ipaddress

from infra.clouds.profile import CloudProfile, Counted, MarketAnswers, DiskEncryption, SharedFsKind


class TencentcloudProfile(CloudProfile):
    name = "tencentcloud"
    display_name = "Tencent Cloud"
    provider = "tencentcloud"
    sdk_package = "tencentcloud_iac_pulumi"
    platform = "infra.clouds.tencentcloud.platform:TencentcloudPlatform"
    mocks_module = "infra.clouds.tencentcloud.mocks"
    instance_passwords = True
    disk_encryption = DiskEncryption("encrypt", (True,), sdk_gap_possible=True)

    storage_scheme = "cosn"
    app_id_missing = ("is required: COS bucket names end in -<APPID>; find it under Account Info in the Tencent "
                      "Cloud console")

    def bucket_name(self, prefix: str, region: str, app_id: int | str | None) -> str:
        return f"{prefix}-{region}-{app_id or ''}"

    def storage_endpoint(self, bucket_region: str, node_region: str) -> str:
        """One name, resolved to an internal address from the same region (COS "CVM accesses
        COS": same-region access is routed internally)."""
        return f"https://cos.{bucket_region}.myqcloud.com"

    metadata_url = "http://metadata.tencentyun.com"

    def storage_credentials(self, kind: str) -> str:
        """CVM CAM roles come from the metadata service; TKE pods use their own CAM role (pod identity)."""
        return "tke-pod-identity" if kind == "kubernetes" else "instance-role"

    sets_aws_region = False
    operator_keys = ("TENCENTCLOUD_SECRET_ID", "TENCENTCLOUD_SECRET_KEY")
    instance_tags_in_metadata = False

    subnet_word = "subnet"
    stores_own_subnet = True
    store_subnet_clear_of = "subnets"
    vpc_prefix_floor_192 = 16  # a VPC inside 192.168.0.0/16 may be the whole /16

    def kubernetes_pod_subnets(self, vpc: ipaddress.IPv4Network,
                               subnets: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
        return []  # TKE's cluster CIDR lies outside every VPC

    registry_regional = True  # TCR VPC attachments are regional

    fabric = "hcc"
    plain_network = "the VPC network (TCP sockets)"
    placement_monthly_usd = 0.0  # HCC clusters are billed through their instances (CreateHpcCluster has no price)

    def fabric_placement(self, kind: str, market: MarketAnswers) -> str:
        return "HCC cluster (CvmHpcCluster)"

    def fabric_unbuildable(self, kind: str, market: MarketAnswers) -> str | None:
        if kind == "kubernetes":
            return ("TKE node pools cannot be placed in an HCC cluster (tencentcloud_kubernetes_node_pool has no "
                    "hpc_cluster_id)")
        return None

    fabric_name = "HCC RDMA"

    def fabric_row_problem(self, interfaces: int, devices: int, primary_every: int) -> str | None:
        if interfaces != 0:
            return "HCC RDMA ports come with the HCC cluster; interfaces must be 0"
        if primary_every:
            return "efa_primary_every applies to efa rows only"
        return None

    def fabric_fixed_count(self, nodes: int) -> str | None:
        return (f"an HCC group is {nodes} fixed CVM instances in its HCC cluster (Auto Scaling cannot place "
                "instances in one through the provider)")

    def fabric_env(self, kind: str, vpc_cidr: str) -> dict[str, str]:
        """Tencent-authored training scripts: GID 3, TC 160, SL 3, GDR level 2 (secondary evidence,
        docs/fabric.md says so)."""
        return {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_bond", "NCCL_IB_GID_INDEX": "3",
                "NCCL_IB_TC": "160", "NCCL_IB_SL": "3", "NCCL_NET_GDR_LEVEL": "2"}

    def fabric_pod_resources(self, devices: int) -> dict[str, str]:
        return {}  # TKE pools get no HCC (fabric_unbuildable)

    fabric_device_plugin = None

    kubernetes_service = "TKE"
    kubernetes_pods_in_vpc = False
    kubernetes_pool_marks_rule = None
    kubernetes_pool_mixes_markets = False
    multi_node_one_zone = False  # without an HCC a multi-node group spreads over its subnets
    kubernetes_job_success_policy = False  # TKE 1.30: the feature gate is off (KEP-3998: GA in 1.33)
    kubernetes_nodeadm = False
    pod_identity_egress = ()

    # CVM / AS / TKE: "Base64-encoded User Data text, the length limit is 16KB"
    # (tencentcloud_iac_pulumi kubernetes/node_pool.py).
    user_data_limit: tuple[int, Counted] = (16 * 1024, "base64")
    kubernetes_user_data_limit: tuple[int, Counted] | None = None

    schedules_in_beijing_time = True  # AS scheduled actions recur in Beijing time (infra/core/schedule.py)
    # CFS: cloud.tencent.com "Using CFS on Linux clients".
    shared_fs_kinds = (
        SharedFsKind("cfs", "nfs", "vers=3,nolock,proto=tcp,hard,timeo=600,retrans=2,noresvport,_netdev",
                     "255.255.255.255:/abcdefgh", performance=True),
    )
    price_refresh = "infra.clouds.tencentcloud.prices:refresh"

    def fixed_instances(self, nodes: int, market: MarketAnswers, fabric: bool) -> int:
        """CVM instances rather than members of its AS group: all of a reserved group and of an HCC
        group (AS cannot place nodes in an HCC), and a spot group's on-demand base."""
        if market.prepaid or fabric:
            return nodes
        return market.on_demand_base if market.spot else 0
