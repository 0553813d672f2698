"""Tencent Cloud managed Kubernetes: a TKE cluster per network with Kubernetes GPU groups, an
untainted system pool for the add-ons, GPU node pools (SPOTPAID or on-demand, an on-demand base
as its own pool, GPU driver and CUDA versions, taints, labels, min/max, encrypted disks, Ubuntu
nodes), the API endpoint opened after the pools, and the cloud-neutral node agents and training
Job. TKE installs the NVIDIA device plugin on GPU nodes itself."""

from __future__ import annotations

import json
from collections.abc import Mapping

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra import userdata
from infra.checks.cloud_rules import POD_CIDR, SERVICE_CIDR
from infra.clouds.tencentcloud.access import TencentAccess
from infra.clouds.tencentcloud.fleet import DISK, spot_max_price
from infra.core import catalog as cat
from infra.core.names import fit
from infra.k8s.cluster import cluster_workloads
from infra.k8s.job import Identity
from infra.model.pools import pool_parts
from infra.model.spec import StackSpec
from infra.pods import NAMESPACE
from infra.resolve.access import trainer_grants
from infra.resolve.groups import LABEL_CAPACITY, LABEL_POOL, SYSTEM_DISK_GB, ResolvedGroup
from infra.resolve.sharedfs import SharedFsOutputs
from infra.teams.registry import Registry

TKE_VERSION = "1.30.0"
# The node scripts need Python >= 3.7; TKE's default node OS, tlinux2.4 (CentOS 7 based), has
# none. The OS name, not its display name (tencentcloud_iac_pulumi kubernetes/node_pool.py node_os).
NODE_OS = "ubuntu22.04x86_64"
# Endpoint fields the ClusterEndpoint resource owns; the cluster reads their live state back and
# must not undo them (terraform-provider-tencentcloud: "do not use this resource and
# Kubernetes.Cluster to operate cluster public network/intranet access at the same time").
ENDPOINT_FIELDS = ["clusterInternet", "clusterIntranet", "clusterIntranetSubnetId", "clusterInternetSecurityGroup",
                   "clusterIntranetDomain", "clusterInternetDomain"]
# TKE installs these on GPU nodes; pin them with the stack so a node pool's GPUs match its image.
GPU_DRIVER = {"name": "NVIDIA-Linux-x86_64-535.161.08.run", "version": "535.161.08"}
GPU_CUDA = {"name": "cuda_12.2.2_535.104.05_linux.run", "version": "12.2.2"}
# TKE pod identity (TKE "Pod identity" / OIDC resource access control, document/product/457/57285):
# the pod-identity webhook gives a pod whose service account carries ROLE_ANNOTATION a projected
# token for AUDIENCE and the TKE_* variables training/credentials.py reads.
ROLE_ANNOTATION = "tke.cloud.tencent.com/role-arn"
AUDIENCE_ANNOTATION = "tke.cloud.tencent.com/audience"
AUDIENCE = "sts.cloud.tencent.com"  # the webhook's default client id, which the OIDC provider lists


def pod_trust(parts: str) -> str:
    """The trust policy of a group's pod role; `parts` is "<owner uin>\n<cluster id>\n<account>":
    the cluster's CAM OIDC provider (named by the cluster id, tencentcloud_iac_pulumi
    kubernetes/auth_attachment.py: cam.get_oidc_config(name=<cluster id>)), for the Job's service
    account's token alone (CAM "Creating a role for an OIDC IdP", document/product/598/96013)."""
    uin, cluster_id, account = parts.split("\n")
    return json.dumps({"version": "2.0", "statement": [{
        "action": ["name/sts:AssumeRoleWithWebIdentity"], "effect": "allow",
        "principal": {"federated": [f"qcs::cam::uin/{uin}:oidc-provider/{cluster_id}"]},
        "condition": {"string_equal": {"oidc:aud": [AUDIENCE],
                                       "oidc:sub": [f"system:serviceaccount:{NAMESPACE}:{account}"]}}}]})


@dataclass
class TencentTkeArgs:
    spec: StackSpec
    groups: list[ResolvedGroup]
    vpc_id: pulumi.Output[str]
    subnet_ids: list[pulumi.Output[str]]
    security_group_id: pulumi.Output[str]
    role_names: dict[str, pulumi.Output[str]]  # each group's node CAM role
    images: Mapping[str, pulumi.Output[str]]  # group name -> its trainer image
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    access: TencentAccess  # where the pods' own CAM roles are made
    shared: SharedFsOutputs | None = None  # the network's shared file system (networks[].sharedFs)
    teams: Registry | None = None  # the checked team registry kubernetes.queues names (the Stack's)


class TencentTke(pulumi.ComponentResource):
    cluster: tencentcloud.kubernetes.Cluster

    def __init__(self, name: str, args: TencentTkeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:TkeGpuCluster", name, None, opts)
        spec, tags = args.spec, args.tags
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        # Created without API endpoints: with one, the provider waits for a running worker that
        # the pools (which need this cluster's id) cannot have started yet, and times out
        # (resource_tc_kubernetes_cluster_extension.go, CheckOneOfClusterNodeReady).
        self.cluster = tencentcloud.kubernetes.Cluster(
            f"{name}-tke", cluster_name=name, cluster_version=TKE_VERSION, vpc_id=args.vpc_id,
            cluster_cidr=str(POD_CIDR), service_cidr=str(SERVICE_CIDR), cluster_deploy_type="MANAGED_CLUSTER",
            cluster_level="L20", container_runtime="containerd", network_type="GR",
            deletion_protection=spec.env == "prod", tags=tags,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=ENDPOINT_FIELDS)))
        self.system = self._system_pool(name, args, child)
        self.pools: list[tencentcloud.kubernetes.NodePool] = []
        for g in args.groups:
            self.pools += self._pools(g, args, child)
        self.endpoint = self._endpoint(name, args, child)
        # NetworkPolicy is enforced on TKE by its NetworkPolicy add-on, not by the global-router
        # network itself (TKE "Network Policy": "TKE provides network isolation through the
        # Network Policy add-on", document/product/457/31424).
        tencentcloud.kubernetes.Addon(f"{name}-networkpolicy", cluster_id=self.cluster.id, addon_name="networkpolicy",
                                      opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                                          depends_on=[self.endpoint])))
        public = bool(spec.kubernetes.api_access_cidrs)
        self.kubeconfig: pulumi.Output[str] = pulumi.Output.secret(
            self.endpoint.kube_config if public else self.endpoint.kube_config_intranet)
        identities, oidc = self._pod_identity(name, args, child)
        # After the webhook: a Job's pods created before it would get no identity.
        cluster_workloads(name, self.kubeconfig, [self.endpoint, oidc], spec, args.groups, parent=self,
                          device_plugin=False, trainer_images=args.images, shared=args.shared, teams=args.teams, identities=identities)
        self.register_outputs({"clusterId": self.cluster.id})

    def _pod_identity(self, name: str, args: TencentTkeArgs, child: pulumi.ResourceOptions
                      ) -> tuple[dict[str, Identity], tencentcloud.kubernetes.AuthAttachment]:
        """Each training group's pods assume a CAM role of their own with their service account's
        token, so no pod needs the node's role and the metadata service is closed to every
        namespace (infra/k8s/netpol.py). The cluster's issuer becomes a CAM OIDC provider and the
        pod-identity webhook is installed (AuthAttachment: auto_create_oidc_config needs
        auto_install_pod_identity_webhook_addon; the discovery documents readable anonymously, as
        CAM fetches them); each role trusts that provider for `system:serviceaccount:training:
        <group>-trainer` only (pod_trust)."""
        oidc = tencentcloud.kubernetes.AuthAttachment(
            f"{name}-oidc", cluster_id=self.cluster.id, use_tke_default=True, auto_create_discovery_anonymous_auth=True,
            auto_create_oidc_config=True, auto_install_pod_identity_webhook_addon=True,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[self.endpoint])))
        uin = tencentcloud.user.get_info_output(opts=pulumi.InvokeOutputOptions(provider=args.provider,
                                                                                parent=self)).owner_uin
        identities = {}
        for g in args.groups:
            account = f"{g.name}-trainer"
            trust = pulumi.Output.format("{0}\n{1}\n{2}", uin, self.cluster.id, account).apply(pod_trust)
            role = args.access.role(f"{name}-{g.name}-pods", f"{args.spec.env}-{g.name}-pods", trust,
                                    trainer_grants(args.spec, g), f"pods of {g.name}: its dataset, its own checkpoints",
                                    after=[oidc])
            arn = pulumi.Output.format("qcs::cam::uin/{0}:roleName/{1}", uin, role.name)
            identities[g.name] = Identity(service_account=account,
                                          annotations={ROLE_ANNOTATION: arn, AUDIENCE_ANNOTATION: AUDIENCE})
        return identities, oidc

    def _endpoint(self, name: str, args: TencentTkeArgs,
                  child: pulumi.ResourceOptions) -> tencentcloud.kubernetes.ClusterEndpoint:
        """The API endpoints, after the pools: the intranet one for the VPCs, and a public one open
        to `kubernetes.apiAccessCidrs` only, through a security group of its own. The provider
        waits for one running worker (the system pool's), as its docs ask: "Recommend using
        depends_on to make sure endpoint create after node pools or workers does"."""
        cidrs = [str(c) for c in args.spec.kubernetes.api_access_cidrs]
        group = None
        if cidrs:
            group = tencentcloud.security.Group(f"{name}-api-sg", name=f"{name}-api",
                                                description="TKE public API endpoint: operators and CI runners only",
                                                tags=args.tags, opts=child)
            tencentcloud.security.GroupRuleSet(
                f"{name}-api-rules", security_group_id=group.id,
                ingresses=[tencentcloud.security.GroupRuleSetIngressArgs(
                    action="ACCEPT", cidr_block=c, protocol="TCP", port="443", description="Kubernetes API")
                    for c in cidrs], opts=pulumi.ResourceOptions(parent=group))
        return tencentcloud.kubernetes.ClusterEndpoint(
            f"{name}-endpoint", cluster_id=self.cluster.id, cluster_intranet=True,
            cluster_intranet_subnet_id=args.subnet_ids[0], cluster_internet=bool(cidrs),
            cluster_internet_security_group=group.id if group else None,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[self.system, *self.pools])))

    def _system_pool(self, name: str, args: TencentTkeArgs,
                     child: pulumi.ResourceOptions) -> tencentcloud.kubernetes.NodePool:
        """Untainted nodes for CoreDNS and the add-ons; also the running worker the endpoint waits for."""
        pool = cat.load_system_pools()["tencentcloud"]
        nodes = int(pool["nodes"])
        return tencentcloud.kubernetes.NodePool(
            f"{name}-system", name="system", cluster_id=self.cluster.id, vpc_id=args.vpc_id,
            subnet_ids=args.subnet_ids, min_size=nodes, max_size=nodes, desired_capacity=nodes, enable_auto_scale=False,
            node_os=NODE_OS, multi_zone_subnet_policy="EQUALITY",
            auto_scaling_config=tencentcloud.kubernetes.NodePoolAutoScalingConfigArgs(
                instance_type=str(pool["instanceType"]), instance_charge_type="POSTPAID_BY_HOUR",
                system_disk_type=DISK, system_disk_size=50, orderly_security_group_ids=[args.security_group_id],
                public_ip_assigned=False, internet_max_bandwidth_out=0),
            labels={LABEL_POOL: "system"}, tags=args.tags, opts=child)

    def _pools(self, g: ResolvedGroup, args: TencentTkeArgs,
               child: pulumi.ResourceOptions) -> list[tencentcloud.kubernetes.NodePool]:
        spec = args.spec
        types, disk_gb = list(g.types), g.scratch_disk_gb
        labels = g.labels()
        pools = []
        fixed_charge = "PREPAID" if g.market.prepaid else "POSTPAID_BY_HOUR"
        for part in pool_parts(g.group):
            suffix, lo, hi, desired, spot = part.suffix, part.min, part.max, part.desired, part.spot
            charge = "SPOTPAID" if spot else fixed_charge
            pools.append(tencentcloud.kubernetes.NodePool(
                f"{g.name}-{suffix}", name=fit(f"{g.name}-{suffix}", "tkeNodePool"), cluster_id=self.cluster.id,
                vpc_id=args.vpc_id, subnet_ids=args.subnet_ids, min_size=lo, max_size=hi, desired_capacity=desired,
                enable_auto_scale=True, multi_zone_subnet_policy="EQUALITY", retry_policy="INCREMENTAL_INTERVALS",
                node_os=NODE_OS,
                auto_scaling_config=tencentcloud.kubernetes.NodePoolAutoScalingConfigArgs(
                    instance_type=types[0], backup_instance_types=types[1:] or None, instance_charge_type=charge,
                    instance_charge_type_prepaid_period=1 if charge == "PREPAID" else None,
                    spot_instance_type="one-time" if spot else None,
                    # SPOTPAID "must set spot_instance_type and spot_max_price at the same time"
                    # (resource_tc_kubernetes_node_pool.go); without a cap, the on-demand price.
                    spot_max_price=spot_max_price(g) if spot else None,
                    system_disk_type=DISK, system_disk_size=SYSTEM_DISK_GB,
                    data_disks=[tencentcloud.kubernetes.NodePoolAutoScalingConfigDataDiskArgs(
                        disk_type=DISK, disk_size=disk_gb, encrypt=True, delete_with_instance=True)] if disk_gb else None,
                    orderly_security_group_ids=[args.security_group_id], cam_role_name=args.role_names[g.name],
                    public_ip_assigned=False, internet_max_bandwidth_out=0),
                node_config=tencentcloud.kubernetes.NodePoolNodeConfigArgs(
                    user_data=userdata.for_cluster_group(spec, g, args.shared),
                    gpu_args=tencentcloud.kubernetes.NodePoolNodeConfigGpuArgsArgs(
                        driver=GPU_DRIVER, cuda=GPU_CUDA, mig_enable=False)),
                labels={**labels, LABEL_CAPACITY: "spot" if spot else "on-demand"},
                taints=[tencentcloud.kubernetes.NodePoolTaintArgs(key="nvidia.com/gpu", value="true",
                                                                  effect="NoSchedule")],
                tags=g.tags(args.tags),
                opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=["desiredCapacity"]))))
        return pools
