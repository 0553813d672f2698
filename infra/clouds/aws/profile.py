"""AWS's answers to infra/clouds/profile.py."""

from __future__ import annotations

import ipaddress

from infra.clouds.profile import CloudProfile, Counted, MarketAnswers, SharedFsKind


class AwsProfile(CloudProfile):
    name = "aws"
    display_name = "AWS"
    provider = "aws"
    sdk_package = "pulumi_aws"
    platform = "infra.clouds.aws.platform:AwsPlatform"
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

    fabric_name = "EFA (Elastic Fabric Adapter)"

    def fabric_row_problem(self, interfaces: int, devices: int, primary_every: int) -> str | None:
        if interfaces < 1:
            return "an efa type declares at least one interface"
        if interfaces != devices:
            return "each EFA interface is one EFA device; interfaces must equal devices"
        return None

    def fabric_fixed_count(self, nodes: int) -> str | None:
        return None

    def fabric_env(self, kind: str, vpc_cidr: str) -> dict[str, str]:
        """awsome-distributed-training efa-cheatsheet.md and fsdp templates: FI_PROVIDER=efa,
        FI_EFA_USE_DEVICE_RDMA=1 on p4d/p5, FI_EFA_USE_HUGE_PAGE=0 where no huge pages are
        reserved (a pod requests them: fabric_pod_resources)."""
        kube = kind == "kubernetes"
        # VM: the ENA interfaces are en*; a pod has eth0 (VPC CNI).
        env = {"NCCL_SOCKET_IFNAME": "eth0" if kube else "en", "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
        if not kube:
            env["FI_EFA_USE_HUGE_PAGE"] = "0"
        return env

    def fabric_pod_resources(self, devices: int) -> dict[str, str]:
        """The EFA device plugin's resource (EKS user guide device-management-efa); libfabric's EFA
        provider allocates its bounce buffers from huge pages: the amount the awsome nccl-tests Job
        requests on p5.48xlarge (micro-benchmarks/nccl-tests/kubernetes/nccl-tests.yaml)."""
        return {"vpc.amazonaws.com/efa": str(devices), "hugepages-2Mi": "5120Mi"}

    # aws/eks-charts stable/aws-efa-k8s-device-plugin's image, on ECR Public (advertises
    # vpc.amazonaws.com/efa): the EKS AMIs carry the EFA host components but not the plugin.
    fabric_device_plugin = "public.ecr.aws/eks/aws-efa-k8s-device-plugin:v0.5.6"

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
    # NFS options are the clouds' own recommendations; _netdev orders the mount after the network.
    # EFS mounts through AWS's mount helper (amazon-efs-utils, `mount -t efs`): `tls` wraps NFS in
    # TLS (stunnel to the mount target), `iam` signs the mount with the node's role, and the access
    # point (`accesspoint=fsap-…`, added per file system) fixes the POSIX user and root directory
    # (EFS user guide: mounting-fs-mount-helper-ec2-linux, efs-access-points, encryption-in-transit;
    # the file-system policy refuses anything else, infra/clouds/aws/sharedfs.py). Pods mount it
    # through the EFS CSI driver (an EKS add-on; kubernetes-sigs/aws-efs-csi-driver: "access point
    # mounts require TLS", encryptInTransit). Lustre needs the FSx CSI driver, which the stack does
    # not install. FSx for Lustre PERSISTENT_2 capacity: 1200 GiB, 2400 GiB, then multiples of 2400
    # GiB (aws.fsx.LustreFileSystem storage_capacity; FSx API CreateFileSystem StorageCapacity).
    shared_fs_kinds = (
        SharedFsKind("efs", "efs", "tls,iam,_netdev", "{host}:/", access_point="fsap-0123456789abcdef0",
                     csi_driver="efs.csi.aws.com", csi_attributes=(("encryptInTransit", "true"),)),
        SharedFsKind("fsx-lustre", "lustre", "relatime,flock,_netdev", "{host}@tcp:/abcdefgh",
                     pods_would_need="the FSx CSI driver", title="FSx for Lustre", sizes_gb=(1200, 2400),
                     size_step_gb=2400, priced_by_throughput=True),
    )
    price_refresh = "infra.clouds.aws.prices:refresh"

    def fixed_instances(self, nodes: int, market: MarketAnswers, fabric: bool) -> int:
        """Every node of an AWS group is in its Auto Scaling group (a reserved group reserves capacity
        for it): none is a fixed instance."""
        return 0
