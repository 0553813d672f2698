"""Alibaba Cloud's answers to infra/clouds/profile.py."""

from __future__ import annotations

import ipaddress

from infra.clouds.profile import CloudProfile, Counted, MarketAnswers, DiskEncryption, SharedFsKind


def pod_switch_cidrs(vpc: ipaddress.IPv4Network, subnets: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
    """The /20s Terway's pods may take, one per zone in order: the highest free /20s of the VPC,
    clear of the node vSwitches (ACK recommends pod vSwitches apart from the nodes', in the same
    zones). infra/clouds/alicloud/network.py lays them out from this list."""
    return [c for c in reversed(list(vpc.subnets(new_prefix=max(20, vpc.prefixlen + 1))))
            if not any(c.overlaps(t) for t in subnets)]


class AlicloudProfile(CloudProfile):
    name = "alicloud"
    display_name = "Alibaba Cloud"
    provider = "alicloud"
    sdk_package = "pulumi_alicloud"
    platform = "infra.clouds.alicloud.platform:AlicloudPlatform"
    mocks_module = "infra.clouds.alicloud.mocks"
    instance_passwords = True
    disk_encryption = DiskEncryption("encrypted", (True, "true"), sdk_gap_possible=False)

    storage_scheme = "oss"
    app_id_missing = None

    def bucket_name(self, prefix: str, region: str, app_id: int | str | None) -> str:
        return f"{prefix}-{region}"

    def storage_endpoint(self, bucket_region: str, node_region: str) -> str:
        """OSS's S3-compatible endpoint, the internal one from the same region (OSS "Regions and
        endpoints": internal endpoints serve ECS in the same region)."""
        internal = "-internal" if node_region == bucket_region else ""
        return f"https://s3.oss-{bucket_region}{internal}.aliyuncs.com"

    metadata_url = "http://100.100.100.200"

    def storage_credentials(self, kind: str) -> str:
        """ECS RAM roles come from the metadata service; ACK pods use their own RAM role (RRSA)."""
        return "ack-rrsa" if kind == "kubernetes" else "instance-role"

    sets_aws_region = False
    operator_keys = ("ALICLOUD_ACCESS_KEY", "ALICLOUD_SECRET_KEY")
    instance_tags_in_metadata = False

    subnet_word = "vSwitch"
    stores_own_subnet = True
    store_subnet_clear_of = "subnets and the ACK pod vSwitches"
    vpc_prefix_floor_192 = None

    def kubernetes_pod_subnets(self, vpc: ipaddress.IPv4Network,
                               subnets: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
        return pod_switch_cidrs(vpc, subnets)[:len(subnets)]

    registry_regional = True  # ACR EE VPC endpoints are regional

    fabric = "erdma"
    plain_network = "the VPC network (TCP sockets)"
    placement_monthly_usd = 0.0  # ECS deployment sets are "free of charge" (ECS user guide, deployment sets)

    def fabric_placement(self, kind: str, market: MarketAnswers) -> str:
        """An ESS scaling configuration cannot take a deployment set (infra/data/capabilities.yaml sdkGaps)."""
        if kind == "vm" and not market.prepaid:
            return "one vSwitch (ESS scaling configurations take no deployment set)"
        return "deployment set (LowLatency)"

    def fabric_unbuildable(self, kind: str, market: MarketAnswers) -> str | None:
        if kind == "kubernetes" and market.spot:
            return ("an eRDMA ACK pool sits in a LowLatency deployment set, and node pools with a deployment set "
                    "cannot hold preemptible instances (ACK \"Associate a deployment set with a node pool\"); use "
                    "market on-demand or reserved for it")
        return None

    fabric_name = "eRDMA (elastic RDMA)"

    def fabric_row_problem(self, interfaces: int, devices: int, primary_every: int) -> str | None:
        if interfaces < 1:
            return "an erdma type declares at least one interface"
        if primary_every:
            return "efa_primary_every applies to efa rows only"
        return None

    def fabric_fixed_count(self, nodes: int) -> str | None:
        return None

    def fabric_env(self, kind: str, vpc_cidr: str) -> dict[str, str]:
        """alibabacloud-erdma-controller docs/erdma-benchmark: NCCL_IB_HCA=erdma, GID per device
        (-1 with AF_INET / RoCEv2 / the ERI's range), NCCL_NET_GDR_LEVEL=SYS."""
        return {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "erdma", "NCCL_IB_GID_INDEX": "-1",
                "NCCL_IB_ADDR_FAMILY": "AF_INET", "NCCL_IB_ROCE_VERSION_NUM": "2", "NCCL_IB_ADDR_RANGE": vpc_cidr,
                "NCCL_NET_GDR_LEVEL": "SYS"}

    def fabric_pod_resources(self, devices: int) -> dict[str, str]:
        """The eRDMA controller's resource (alibabacloud-erdma-controller)."""
        return {"aliyun/erdma": str(devices)}

    fabric_device_plugin = None  # the ACK eRDMA controller (an add-on: infra/clouds/alicloud/kubernetes.py)

    kubernetes_service = "ACK"
    kubernetes_pods_in_vpc = False
    kubernetes_pool_marks_rule = "ackAutoscalingPoolMarks"
    kubernetes_pool_mixes_markets = True  # an ACK pool mixes markets and carries its group's market
    multi_node_one_zone = False  # a deployment set spreads over the group's vSwitches
    kubernetes_job_success_policy = True  # ACK's newest (KEP-3998: GA in 1.33)
    kubernetes_nodeadm = False
    pod_identity_egress = ()

    # ECS / ESS / ACK: user data "base64 ... up to 32 KB" (pulumi_alicloud ecs/instance.py user_data).
    user_data_limit: tuple[int, Counted] = (32 * 1024, "base64")
    kubernetes_user_data_limit: tuple[int, Counted] | None = None

    schedules_in_beijing_time = False
    # NAS: help.aliyun.com "Mount an NFS file system on a Linux ECS instance".
    shared_fs_kinds = (
        SharedFsKind("nas", "nfs", "vers=3,nolock,proto=tcp,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,"
                     "noresvport,_netdev", "{host}:/", performance=True),
    )
    price_refresh = "infra.clouds.alicloud.prices:refresh"

    def fixed_instances(self, nodes: int, market: MarketAnswers, fabric: bool) -> int:
        """All of a reserved group's nodes are ECS subscription instances rather than members of its
        ESS group; none otherwise."""
        return nodes if market.prepaid else 0
