"""Tencent Cloud managed Kubernetes: a TKE cluster per network with Kubernetes GPU groups
(intranet API only), GPU node pools (SPOTPAID or on-demand, an on-demand base as its own pool,
GPU driver and CUDA versions, taints, labels, min/max, encrypted disks) and the cloud-neutral
training Job. TKE installs the NVIDIA device plugin on GPU nodes itself."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra import userdata
from infra.clouds.tencentcloud.fleet import DISK, spot_max_price
from infra.groups import SYSTEM_DISK_GB, ResolvedGroup
from infra.k8s import cluster_workloads, pool_parts
from infra.spec import StackSpec

TKE_VERSION = "1.30.0"
CLUSTER_CIDR = "172.20.0.0/16"  # outside every stack VPC (10.0.0.0/8)
SERVICE_CIDR = "172.21.0.0/20"
# TKE installs these on GPU nodes; pin them with the stack so a node pool's GPUs match its image.
GPU_DRIVER = {"name": "NVIDIA-Linux-x86_64-535.161.08.run", "version": "535.161.08"}
GPU_CUDA = {"name": "cuda_12.2.2_535.104.05_linux.run", "version": "12.2.2"}


@dataclass
class TencentTkeArgs:
    spec: StackSpec
    groups: list[ResolvedGroup]
    vpc_id: pulumi.Output[str]
    subnet_ids: list[pulumi.Output[str]]
    security_group_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    provider: pulumi.ProviderResource
    tags: dict[str, str]


class TencentTke(pulumi.ComponentResource):
    cluster: tencentcloud.kubernetes.Cluster

    def __init__(self, name: str, args: TencentTkeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:TkeGpuCluster", name, None, opts)
        spec, tags = args.spec, args.tags
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        # The API server is reachable from the VPC only (peered networks and VPN included).
        self.cluster = tencentcloud.kubernetes.Cluster(
            f"{name}-tke", cluster_name=name, cluster_version=TKE_VERSION, vpc_id=args.vpc_id,
            cluster_cidr=CLUSTER_CIDR, service_cidr=SERVICE_CIDR, cluster_deploy_type="MANAGED_CLUSTER",
            cluster_level="L20", container_runtime="containerd", network_type="GR",
            cluster_internet=False, cluster_intranet=True, cluster_intranet_subnet_id=args.subnet_ids[0],
            deletion_protection=spec.env == "prod", tags=tags, opts=child)
        self.pools: list[tencentcloud.kubernetes.NodePool] = []
        for g in args.groups:
            self.pools += self._pools(g, args, child)
        self.kubeconfig: pulumi.Output[str] = pulumi.Output.secret(self.cluster.kube_config_intranet)
        cluster_workloads(name, self.kubeconfig, self.pools, spec, args.groups, parent=self, device_plugin=False)
        self.register_outputs({"clusterId": self.cluster.id})

    def _pools(self, g: ResolvedGroup, args: TencentTkeArgs,
               child: pulumi.ResourceOptions) -> list[tencentcloud.kubernetes.NodePool]:
        spec = args.spec
        types, disk_gb = list(g.types), g.scratch_disk_gb
        labels = g.labels()
        pools = []
        fixed_charge = "PREPAID" if g.market.type == "reserved" else "POSTPAID_BY_HOUR"
        for part in pool_parts(g.group):
            suffix, lo, hi, desired, spot = part.suffix, part.min, part.max, part.desired, part.spot
            charge = "SPOTPAID" if spot else fixed_charge
            pools.append(tencentcloud.kubernetes.NodePool(
                f"{g.name}-{suffix}", name=f"{g.name}-{suffix}", cluster_id=self.cluster.id, vpc_id=args.vpc_id,
                subnet_ids=args.subnet_ids, min_size=lo, max_size=hi, desired_capacity=desired,
                enable_auto_scale=True, multi_zone_subnet_policy="EQUALITY", retry_policy="INCREMENTAL_INTERVALS",
                auto_scaling_config=tencentcloud.kubernetes.NodePoolAutoScalingConfigArgs(
                    instance_type=types[0], backup_instance_types=types[1:] or None, instance_charge_type=charge,
                    instance_charge_type_prepaid_period=1 if charge == "PREPAID" else None,
                    spot_instance_type="one-time" if spot else None,
                    spot_max_price=spot_max_price(g) if spot else None,
                    system_disk_type=DISK, system_disk_size=SYSTEM_DISK_GB,
                    data_disks=[tencentcloud.kubernetes.NodePoolAutoScalingConfigDataDiskArgs(
                        disk_type=DISK, disk_size=disk_gb, encrypt=True, delete_with_instance=True)] if disk_gb else None,
                    orderly_security_group_ids=[args.security_group_id], cam_role_name=args.role_name,
                    public_ip_assigned=False, internet_max_bandwidth_out=0),
                node_config=tencentcloud.kubernetes.NodePoolNodeConfigArgs(
                    user_data=userdata.for_node_pool_script(userdata.node_context(spec, g)),
                    gpu_args=tencentcloud.kubernetes.NodePoolNodeConfigGpuArgsArgs(
                        driver=GPU_DRIVER, cuda=GPU_CUDA, mig_enable=False)),
                labels={**labels, "gpu-training-stack/capacity": "spot" if spot else "on-demand"},
                taints=[tencentcloud.kubernetes.NodePoolTaintArgs(key="nvidia.com/gpu", value="true",
                                                                  effect="NoSchedule")],
                tags={**args.tags, **labels},
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=["desiredCapacity"]))))
        return pools
