"""AWS's answers to infra/clouds/profile.py."""

from __future__ import annotations

import ipaddress

from infra.clouds.profile import CloudProfile, Counted, MarketAnswers


class AwsProfile(CloudProfile):
    name = "aws"
    display_name = "AWS"
    provider = "aws"
    sdk_package = "pulumi_aws"
    platform = "infra.clouds.aws.platform:AwsPlatform"
    fleet_module = "infra.clouds.aws.fleet"
    mocks_module = "infra.clouds.aws.mocks"
    instance_passwords = False
    disk_encryption = None

    storage_scheme = "s3"
    app_id_missing = None

    def bucket_name(self, prefix: str, region: str, app_id: int | str | None) -> str:
        return f"{prefix}-{region}"

    def storage_endpoint(self, bucket_region: str, node_region: str) -> str:
        """The bucket's regional endpoint (a gateway endpoint keeps in-region traffic private)."""
        return f"https://s3.{bucket_region}.amazonaws.com"

    metadata_url = "http://169.254.169.254"

    def storage_credentials(self, kind: str) -> str:
        """boto3's own chain, which reads the instance role and EKS Pod Identity itself."""
        return "default"

    sets_aws_region = True
    operator_keys = None  # the SDK's default chain (profile, SSO, environment)
    instance_tags_in_metadata = True  # the GPU fleets' launch templates expose them

    subnet_word = "subnet"
    stores_own_subnet = False  # the stores take a /28 range of the first subnet (infra/rendezvous.py)
    store_subnet_clear_of = "subnets"
    vpc_prefix_floor_192 = None

    def kubernetes_pod_subnets(self, vpc: ipaddress.IPv4Network,
                               subnets: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
        return []  # EKS pods take addresses of the node subnets

    registry_regional = False

    fabric = "efa"
    plain_network = "the ENA network (TCP sockets)"
    # EC2 user guide placement-groups: "There is no charge for creating a placement group".
    placement_monthly_usd = 0.0

    def fabric_placement(self, kind: str, market: MarketAnswers) -> str:
        return "cluster placement group"

    def fabric_unbuildable(self, kind: str, market: MarketAnswers) -> str | None:
        return None

    kubernetes_service = "EKS"
    kubernetes_pods_in_vpc = True  # EKS uses VPC addresses
    kubernetes_pool_marks_rule = None
    kubernetes_pool_mixes_markets = False  # a spot group's on-demand base is a pool of its own
    multi_node_one_zone = True  # the cluster placement group of a multi-node group is one zone's
    kubernetes_job_success_policy = True  # EKS 1.35 (KEP-3998: GA in 1.33)
    kubernetes_nodeadm = True
    pod_identity_egress = ("169.254.170.23/32",)  # EKS Pod Identity's node agent

    # EC2: "User data is limited to 16 KB, in raw form, before it is base64-encoded" (EC2 user
    # guide, instancedata-add-user-data).
    user_data_limit: tuple[int, Counted] = (16 * 1024, "raw")
    # EKS merges its own NodeConfig part (cluster endpoint, CA bundle, kubelet flags) into the
    # same 16 KB (EKS user guide, launch-templates): keep 4 KB for it.
    kubernetes_user_data_limit: tuple[int, Counted] | None = (12 * 1024, "raw")

    schedules_in_beijing_time = False
    shared_fs_types = ("efs", "fsx-lustre")
    price_refresh = "infra.clouds.aws.prices:refresh"
