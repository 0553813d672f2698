"""Alibaba Cloud managed Kubernetes: an ACK Pro cluster per network with Kubernetes GPU groups
(private API in prod), GPU node pools (spot strategy, instance type fallbacks, taints, labels,
scaling, hardened metadata, encrypted disks), and the cloud-neutral training Job. ACK installs
the NVIDIA device plugin on GPU nodes itself."""

from __future__ import annotations

from collections.abc import Mapping

import json
from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra import userdata
from infra.checks.cloud_rules import SERVICE_CIDR
from infra.clouds.alicloud.access import AlicloudAccess
from infra.clouds.alicloud.fleet import ESSD, spot_strategy
from infra.core import catalog as cat
from infra.k8s.cluster import cluster_workloads
from infra.k8s.job import Identity
from infra.model.spec import StackSpec
from infra.pods import NAMESPACE
from infra.resolve.access import trainer_grants
from infra.resolve.groups import LABEL_POOL, SYSTEM_DISK_GB, ResolvedGroup
from infra.resolve.sharedfs import SharedFsOutputs
from infra.teams.registry import Registry

ACK_SPEC = "ack.pro.small"
# Ubuntu: the node scripts need Python >= 3.7 (Alibaba Cloud Linux 3 ships 3.6).
NODE_IMAGE = "Ubuntu"
RRSA_AUDIENCE = "sts.aliyuncs.com"
RRSA_TOKEN = "/var/run/secrets/ack.alibabacloud.com/rrsa-tokens/token"
# The ACK eRDMA controller's add-on configuration: the OFED driver (GPU / NCCL), every ERI to the
# pod. The add-on's config is its Helm values, where both keys sit under `agent`
# (AliyunContainerService/alibabacloud-erdma-controller deploy/helm/values.yaml).
ERDMA_CONTROLLER_CONFIG = '{"agent": {"preferDriver": "ofed", "allocateAllDevices": true}}'
TERWAY = "terway-eniip"
TERWAY_CONFIG = {"IPVlan": "false", "NetworkPolicy": "true"}  # ACK CreateCluster `addons` (terway-eniip)


def _provider_arn(meta: alicloud.cs.outputs.ManagedKubernetesRrsaMetadata | None) -> str:
    return str(meta.ram_oidc_provider_arn or "") if meta else ""


def _issuer(meta: alicloud.cs.outputs.ManagedKubernetesRrsaMetadata | None) -> str:
    return str(meta.rrsa_oidc_issuer_url or "") if meta else ""


def rrsa_trust(parts: str) -> str:
    """The trust policy of a group's pod role; `parts` is "<provider arn>\n<issuer>\n<account>"."""
    provider_arn, issuer, account = parts.split("\n")
    return json.dumps({"Version": "1", "Statement": [{
        "Action": "sts:AssumeRole", "Effect": "Allow", "Principal": {"Federated": [provider_arn]},
        "Condition": {"StringEquals": {"oidc:aud": RRSA_AUDIENCE, "oidc:iss": issuer,
                                       "oidc:sub": f"system:serviceaccount:{NAMESPACE}:{account}"}}}]})


@dataclass
class AlicloudAckArgs:
    spec: StackSpec
    groups: list[ResolvedGroup]
    switch_ids: list[pulumi.Output[str]]
    pod_switch_ids: list[pulumi.Output[str]]  # Terway's pod vSwitches, one per zone of switch_ids
    security_group_id: pulumi.Output[str]
    role_name: pulumi.Output[str]
    network_cidr: str
    access: AlicloudAccess  # makes the pods' roles
    images: Mapping[str, pulumi.Output[str]]  # group name -> its trainer image
    provider: pulumi.ProviderResource
    tags: dict[str, str]
    shared: SharedFsOutputs | None = None  # the network's shared file system (networks[].sharedFs)
    teams: Registry | None = None  # the checked team registry kubernetes.queues names (the Stack's)


class AlicloudAck(pulumi.ComponentResource):
    cluster: alicloud.cs.ManagedKubernetes

    def __init__(self, name: str, args: AlicloudAckArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:AckGpuCluster", name, None, opts)
        spec, tags = args.spec, args.tags
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        self.cluster = alicloud.cs.ManagedKubernetes(
            f"{name}-ack", name=name, cluster_spec=ACK_SPEC, vswitch_ids=args.switch_ids,
            # Terway (ENI multi-IP) with NetworkPolicy on: the one ACK network plugin that enforces
            # NetworkPolicy (Flannel does not); chosen at creation only (ACK CreateCluster `addons`;
            # provider: "Only works for Create"). Pods take addresses of the pod vSwitches.
            addons=[alicloud.cs.ManagedKubernetesAddonArgs(name=TERWAY, config=json.dumps(TERWAY_CONFIG))],
            pod_vswitch_ids=args.pod_switch_ids, service_cidr=str(SERVICE_CIDR), new_nat_gateway=False,
            # Private API server: ACK's access list lives on a listener of ACK's own load balancer,
            # which the provider cannot attach (data/capabilities.yaml, kubernetesApiAccess).
            slb_internet_enabled=False, security_group_id=args.security_group_id,
            control_plane_log_components=["apiserver", "kcm", "scheduler", "ccm"],
            # RRSA: pods assume their own RAM role with a service-account token (irreversible once on).
            enable_rrsa=True, deletion_protection=spec.env == "prod", tags=tags, opts=child)
        # What node pool auto repair needs on the cluster (pulumi_alicloud cs NodePoolManagementArgs.auto_repair).
        self.repair_addons = [alicloud.cs.KubernetesAddon(f"{name}-{addon}", cluster_id=self.cluster.id, name=addon,
                                                          opts=child)
                              for addon in ("ack-node-problem-detector", "node-lifecycle-controller")]
        # With a security group of our own, ACK adds no rules. Terway's pods take secondary
        # addresses of the nodes' ENIs, which carry this group: the group's own rule admits them,
        # and no pod range outside the VPC exists (Flannel's did). ICMP from the VPC only (ACK
        # "Configure security group rules"; the doc's 0.0.0.0/0 is not needed: no public address).
        alicloud.ecs.SecurityGroupRule(f"{name}-icmp-vpc", type="ingress", ip_protocol="icmp", port_range="-1/-1",
                                       security_group_id=args.security_group_id, cidr_ip=args.network_cidr,
                                       policy="accept", description="ACK: ICMP in the VPC", opts=child)
        # Node pools with scaling enabled grow only once the cluster's autoscaler is on ("The node
        # pool auto scaling mode only takes effect after auto scaling is enabled for the cluster").
        alicloud.cs.AutoscalingConfig(f"{name}-autoscaling", cluster_id=self.cluster.id, scaler_type="cluster-autoscaler",
                                      expander="least-waste", scale_up_from_zero=True, scale_down_enabled=True,
                                      skip_nodes_with_local_storage=False, opts=child)
        self.system = self._system_pool(name, args, child)
        self.pools = [self._pool(g, args, child) for g in args.groups]
        if any(g.fabric is not None for g in args.groups):
            # eRDMA pools: the ACK eRDMA controller installs the driver in OFED mode (the one NCCL's
            # verbs transport needs on GPU nodes) and advertises aliyun/erdma, which the Jobs request
            # (alibabacloud-erdma-controller README, deploy/helm/values.yaml agent.preferDriver; ACK
            # "Use eRDMA in ACK clusters").
            alicloud.cs.KubernetesAddon(f"{name}-erdma", cluster_id=self.cluster.id, name="ack-erdma-controller",
                                        config=ERDMA_CONTROLLER_CONFIG, opts=pulumi.ResourceOptions.merge(
                                            child, pulumi.ResourceOptions(depends_on=self.pools)))
        credential = alicloud.cs.get_cluster_credential_output(
            cluster_id=self.cluster.id, opts=pulumi.InvokeOutputOptions(provider=args.provider, parent=self))
        self.kubeconfig: pulumi.Output[str] = pulumi.Output.secret(credential.kube_config.apply(str))
        cluster_workloads(name, self.kubeconfig, [self.system, *self.pools], spec, args.groups, parent=self,
                          device_plugin=False, trainer_images=args.images, shared=args.shared, teams=args.teams, identities=self._rrsa(name, args))
        self.register_outputs({"clusterId": self.cluster.id})

    def _rrsa(self, name: str, args: AlicloudAckArgs) -> dict[str, Identity]:
        """Each training group's pods assume a RAM role of their own with their service account's
        token (RRSA; ACK user guide "Use RRSA to authorize pods"): trust the cluster's OIDC provider
        for `system:serviceaccount:training:<group>-trainer` only, audience sts.aliyuncs.com. The
        pod gets the role, the provider and a projected token itself — no webhook needed."""
        meta = self.cluster.rrsa_metadata
        provider_arn = meta.apply(_provider_arn)
        issuer = meta.apply(_issuer)
        identities = {}
        for g in args.groups:
            account = f"{g.name}-trainer"
            trust = pulumi.Output.format("{0}\n{1}\n{2}", provider_arn, issuer, account).apply(rrsa_trust)
            role = args.access.role(f"{name}-{g.name}-pods", f"{args.spec.env}-{g.name}-pods", trust,
                                    trainer_grants(args.spec, g), f"pods of {g.name}: its dataset, its own checkpoints")
            identities[g.name] = Identity(
                service_account=account, token_audience=RRSA_AUDIENCE, token_path=RRSA_TOKEN,
                env={"ALIBABA_CLOUD_ROLE_ARN": role.arn, "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": provider_arn,
                     "ALIBABA_CLOUD_OIDC_TOKEN_FILE": RRSA_TOKEN})
        return identities

    def _system_pool(self, name: str, args: AlicloudAckArgs, child: pulumi.ResourceOptions) -> alicloud.cs.NodePool:
        """A fixed pool for CoreDNS and the add-ons: autoscaled nodes carry `k8s.aliyun.com=true`
        and system pods avoid them (pulumi_alicloud cs/node_pool.py)."""
        pool = cat.load_system_pools()["alicloud"]
        return alicloud.cs.NodePool(
            f"{name}-system", node_pool_name="system", cluster_id=self.cluster.id, vswitch_ids=args.switch_ids,
            instance_types=[str(pool["instanceType"])], security_group_ids=[args.security_group_id],
            instance_charge_type="PostPaid", desired_size=str(pool["nodes"]), image_type=NODE_IMAGE,
            system_disk_category=ESSD, system_disk_size=80, system_disk_encrypted=True,
            instance_metadata_options=alicloud.cs.NodePoolInstanceMetadataOptionsArgs(http_tokens="required"),
            labels=[alicloud.cs.NodePoolLabelArgs(key=LABEL_POOL, value="system")], tags=args.tags, opts=child)

    def _pool(self, g: ResolvedGroup, args: AlicloudAckArgs, child: pulumi.ResourceOptions) -> alicloud.cs.NodePool:
        spec = args.spec
        types, disk_gb = list(g.types), g.scratch_disk_gb
        switches, placed = args.switch_ids, None
        if g.fabric is not None:
            # eRDMA: one zone and a LowLatency deployment set (cs_kubernetes_node_pool deployment_set_id).
            switches = switches[:1]
            placed = alicloud.ecs.EcsDeploymentSet(f"{g.name}-ds", deployment_set_name=g.name, strategy="LowLatency",
                                                   description="eRDMA pool: nodes close together", opts=child)
        spot = g.spot
        cap = g.price_cap
        labels = g.labels()
        return alicloud.cs.NodePool(
            f"{g.name}-pool", node_pool_name=g.name, cluster_id=self.cluster.id, vswitch_ids=switches,
            instance_types=types, security_group_ids=[args.security_group_id],
            deployment_set_id=placed.id if placed else None,
            instance_charge_type="PrePaid" if g.market.prepaid else "PostPaid",
            period=1 if g.market.prepaid else None, period_unit="Month" if g.market.prepaid else None,
            spot_strategy=spot_strategy(g),
            spot_price_limits=[alicloud.cs.NodePoolSpotPriceLimitArgs(instance_type=t, price_limit=str(cap))
                               for t in types] if cap else None,
            on_demand_base_capacity=str(g.market.on_demand_base) if spot else None,
            on_demand_percentage_above_base_capacity="0" if spot else None,
            spot_instance_pools=min(len(types), 10) if spot else None, spot_instance_remedy=spot,
            multi_az_policy="COST_OPTIMIZED" if spot else "BALANCE",
            scaling_config=alicloud.cs.NodePoolScalingConfigArgs(enable=True, min_size=g.scaling.min,
                                                                 max_size=g.scaling.max),
            system_disk_category=ESSD, system_disk_size=SYSTEM_DISK_GB, system_disk_encrypted=True, image_type=NODE_IMAGE,
            data_disks=[alicloud.cs.NodePoolDataDiskArgs(category=ESSD, size=disk_gb, encrypted="true")] if disk_gb else None,
            instance_metadata_options=alicloud.cs.NodePoolInstanceMetadataOptionsArgs(http_tokens="required"),
            ram_role_name=args.role_name,
            # Managed pool with auto repair: ACK isolates a node that ack-node-problem-detector
            # finds faulty (GPU Xid included) and restarts or replaces it (ACK "auto-repair";
            # pulumi_alicloud cs NodePoolManagementArgs: needs that add-on and node-lifecycle-controller).
            management=alicloud.cs.NodePoolManagementArgs(
                enable=True, auto_repair=True, auto_repair_policy=alicloud.cs.NodePoolManagementAutoRepairPolicyArgs(
                    restart_node=True)),
            user_data=userdata.for_cluster_group(spec, g, args.shared),
            labels=[alicloud.cs.NodePoolLabelArgs(key=k, value=v) for k, v in labels.items()],
            taints=[alicloud.cs.NodePoolTaintArgs(key="nvidia.com/gpu", value="true", effect="NoSchedule")],
            # ACK: ECS tags + taints + labels of an autoscaling pool must stay under 12 (ACK "Enable node
            # auto scaling"); the spec counts them, and the labels are not repeated as tags.
            tags=g.tags(args.tags), opts=child)
