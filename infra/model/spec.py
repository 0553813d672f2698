"""The stack spec: one typed, validated description of a stack, read from Pulumi config once.

Every cloud implementation reads this model and nothing else. Shape and ranges are checked by
pydantic here; `infra/checks/validation.py` parses config into it, adds the cross-field rules (catalog,
regions, CIDRs, account-site markets), and reports key paths in the stack file's own spelling
(camelCase), e.g. `nodeGroups[1].instanceType`.
"""

from __future__ import annotations

from ipaddress import IPv4Network
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, Field, PlainValidator, StrictInt, model_validator

from infra import clouds
from infra.core import catalog as cat
from infra.clouds import Cloud as Cloud  # the stack file's cloud names: infra/clouds/__init__.py
from infra.model.spec_base import Amount, Name, SpecModel
from infra.model.spec_capacity import Candidate, Market
from infra.model.spec_patterns import EMAIL, IMAGE_REF, MIRROR_URL, NO_NUL, PROJECT_YAML, REGISTRY_HOST, TRACKING_URI

__all__ = ["Amount", "Candidate", "Market", "Name", "SpecModel"]  # read from here by the rest of infra/



def _with_prefix(value: object) -> object:
    """A CIDR says its prefix length: `10.0.0.0` alone would be read as the /32 of one address."""
    if isinstance(value, str) and "/" not in value:
        raise ValueError(f"has no prefix length; write the network as a CIDR, e.g. {value}/16")
    return value


Cidr = Annotated[IPv4Network, BeforeValidator(_with_prefix)]
# The top-level Pulumi config keys (namespace gpu-training-stack), in the order documented.
CONFIG_KEYS = ("env", "protectStateful", "team", "tags", "clouds", "networks", "peerings", "nodeGroups", "kubernetes", "storage",
               "training", "budget", "pricing")
REQUIRED_TAGS = ("owner", "cost-center", "env")


class Mirrors(SpecModel):
    """Where nodes that cannot reach Docker Hub, nvcr.io, PyPI or the Ubuntu archive (mainland
    China) get their images and packages from, inside their own cloud."""

    registry: str | None = Field(None, pattern=REGISTRY_HOST, description="Container registry of this cloud holding copies of the node "
                                                   "agents' images (pulled by full name), e.g. an ACR / TCR host.")
    docker_hub: str | None = Field(None, pattern=MIRROR_URL, description="Docker Hub pull-through mirror URL for the Docker daemon "
                                                     "(registry-mirrors mirrors Docker Hub only).")
    apt: str | None = Field(None, pattern=MIRROR_URL, description="APT mirror base URL for Ubuntu images.")
    nvidia: str | None = Field(None, pattern=MIRROR_URL, description="Mirror of https://nvidia.github.io/libnvidia-container "
                                                 "(the NVIDIA container toolkit's apt repository).")
    pip: str | None = Field(None, pattern=MIRROR_URL, description="PyPI index URL.")


class CloudAccount(SpecModel):
    """One cloud account the stack deploys into."""

    region: str = Field(description="Default region; networks without a region use it.")
    site: Literal["china", "international"] = Field(
        "international", description="Account site; decides which markets it can buy.")
    app_id: str | None = Field(None, pattern=r"^\d{10}$",
                               description="Tencent Cloud APPID, suffix of COS bucket names.")
    mirrors: Mirrors = Field(default_factory=Mirrors, description="Mirrors the nodes use.")
    account_settings: bool = Field(
        False, description="Create the account-wide settings the stack relies on (AWS and Tencent: the env cost "
                           "allocation tag the budget filters on; Alibaba: ACK's AliyunCSManagedAutoScalerRole). "
                           "Exactly one stack per account sets it.")


class Subnet(SpecModel):
    zone: str = Field(description="Availability zone, e.g. us-east-1a, cn-hangzhou-h, ap-guangzhou-3.")
    cidr: Cidr = Field(description="Subnet CIDR, inside the network's CIDR.")


# The values each cloud's profile answers (infra/clouds/<cloud>/profile.py fabric, shared_fs_kinds),
# in the clouds' order: pydantic checks them, and messages and docs list them, from these.
if TYPE_CHECKING:
    SharedFsType = str
    FabricChoice = str
else:
    SharedFsType = Literal[clouds.SHARED_FS_TYPES]
    FabricChoice = Literal[("auto", "none", *clouds.FABRICS)]


class SharedFs(SpecModel):
    """A shared file system in the network (the guide's "NFS shared storage"), mounted on the
    nodes of the groups that ask for it; encrypted, reachable only from the stack's networks."""

    type: SharedFsType = Field(description="efs or fsx-lustre (AWS), nas (Alibaba NAS), cfs (Tencent CFS).")
    size_gb: StrictInt = Field(1200, gt=0, description="FSx for Lustre: the capacity provisioned (1200, 2400, then "
                                                 "multiples of 2400). EFS, NAS, CFS grow as used: the size priced.")
    throughput_per_tib: Literal[125, 250, 500, 1000] = Field(
        125, description="FSx for Lustre (PERSISTENT_2): MB/s of throughput per TiB of storage.")
    performance: bool = Field(False, description="NAS and CFS: the performance class instead of capacity / standard.")
    mount_path: str = Field("/shared", pattern=r"^/[A-Za-z0-9._/-]*[A-Za-z0-9._-]$",
                            description="Where nodes and pods see it.")


class Network(SpecModel):
    """A VPC with subnets (vSwitches) in one region."""

    name: Name = Field(description="Unique name; node groups and peerings refer to it.")
    cloud: Cloud = Field(description="Cloud the VPC lives in.")
    region: str | None = Field(None, description="Region; defaults to the cloud's region.")
    purpose: Literal["training", "data", "inference"] = Field("training", description="What the VPC holds.")
    cidr: Cidr = Field(description="VPC CIDR.")
    subnets: list[Subnet] = Field(min_length=1, description="Private subnets, one per zone.")
    nat: bool = Field(False, description="Create a NAT gateway for egress.")
    ssh_cidrs: list[Cidr] = Field(default_factory=list,
                                         description="CIDRs allowed to SSH in; empty = no SSH (use SSM / cloud shell).")
    shared_fs: SharedFs | None = Field(None, description="A shared file system in this network; groups set "
                                                         "sharedFs: true to mount it.")
    scrape_cidrs: list[Cidr] = Field(
        default_factory=list, description="Where the monitoring scrapes the VM nodes' exporters from (ports 9100, "
                                          "9400 and the trainer's 9401); empty = this network's own CIDR.")


class Peering(SpecModel):
    """A private link between two networks of one cloud."""

    name: Name = Field(description="Unique name of the link.")
    requester: str = Field(description="Network that asks for the peering.")
    accepter: str = Field(description="Network that accepts it.")
    via: Literal["peering", "transit"] = Field(
        "peering", description="peering: VPC peering; transit: one CCN (Tencent only: AWS and Alibaba refuse it, infra/data/capabilities.yaml).")
    bandwidth_mbps: StrictInt | None = Field(None, gt=0, description="Cross-region bandwidth cap (Alibaba, Tencent).")


class GpuRequirement(SpecModel):
    """A GPU requirement the selector turns into instance types."""

    model: str | None = Field(None, description="GPU model, e.g. A100, H100, V100, A10, T4, L4.")
    min_vram_gb: StrictInt = Field(0, ge=0, description="Minimum memory per GPU in GB.")
    count: StrictInt = Field(1, ge=1, description="GPUs per node.")


class Scaling(SpecModel):
    min: StrictInt = Field(ge=0, description="Fewest nodes.")
    max: StrictInt = Field(ge=1, description="Most nodes.")
    desired: StrictInt | None = Field(None, ge=0, description="Nodes at rest; defaults to min.")
    spares: StrictInt = Field(0, ge=0, description="Warm spares beyond the run's world: booted, gated, waiting to "
                                                   "take a lost member's place (multi-node training; docs/spec.md).")

    @property
    def baseline(self) -> int:
        return self.min if self.desired is None else self.desired


class ScheduleAction(SpecModel):
    """A recurring scaling action (UTC cron), e.g. training pools down at night."""

    name: Name = Field(description="Action name.")
    cron: str = Field(description="Five-field cron expression, UTC.")
    desired: StrictInt = Field(ge=0, description="Desired nodes from this time on.")
    min: StrictInt | None = Field(None, ge=0, description="New minimum, if it changes.")
    max: StrictInt | None = Field(None, ge=0, description="New maximum, if it changes.")


class Scratch(SpecModel):
    size_gb: StrictInt = Field(0, ge=0, description="Scratch space per node for datasets, GB.")
    source: Literal["auto", "instance-store", "data-disk"] = Field(
        "auto", description="instance-store: local NVMe only; data-disk: encrypted cloud disk; auto: NVMe when big enough.")


Command = Annotated[list[Annotated[str, Field(min_length=1, pattern=NO_NUL)]], Field(min_length=1)]


class GroupTraining(SpecModel):
    """What this node group trains, where it differs from the stack's `training`."""

    image: str | None = Field(None, pattern=IMAGE_REF, description="Base image of this group's trainer image, pinned by digest: your "
                                                "image with your code; the stack adds the trainer layer on top.")
    command: Command | None = Field(None, description="Your training command, run by the launcher on every process of every node: `[-m, package.module, args...]`, `[script.py, args...]` or an executable with its arguments. `${NAME}` in an argument expands to a trainer-contract variable (e.g. ${DATA_DIR}, ${CHECKPOINT_URL}). Empty: our trainer with `workload`.")


class GpuHealth(SpecModel):
    """The GPU boot gate of this group's nodes (cloudinit/scripts/gts-gpu-health.py)."""

    diag_level: Literal[1, 2] = Field(
        1, description="`dcgmi diag -r` level the gate runs before the trainer starts on each node: 1 (quick, "
                       "seconds) or 2 (medium, about 2 minutes; 2.5 to 10.5 minutes measured on 8-GPU nodes, added to "
                       "every node's start).")


class NodeGroup(SpecModel):
    """GPU nodes: a VM fleet or a managed-Kubernetes node pool."""

    name: Name = Field(description="Unique name.")
    cloud: Cloud = Field(description="Cloud of the nodes.")
    network: str = Field(description="Network (by name) the nodes join.")
    kind: Literal["vm", "kubernetes"] = Field("vm", description="vm: instance fleet; kubernetes: EKS/ACK/TKE node pool.")
    workload: Literal["training", "inference"] = Field("training", description="What runs on the nodes.")
    instance_type: str | None = Field(None, description="Instance type; or give `gpu` and let the selector choose.")
    fallback_types: list[str] = Field(default_factory=list, description="More types for spot capacity pools.")
    gpu: GpuRequirement | None = Field(None, description="GPU requirement instead of an instance type.")
    min_gpu_memory_gb: StrictInt = Field(0, ge=0, description="Smallest GPU memory the workload runs in (e.g. 32 for 3D detection).")
    scaling: Scaling = Field(description="Node counts.")
    market: Market = Field(description="Purchase market.")
    schedule: list[ScheduleAction] = Field(default_factory=list, description="Recurring scaling actions.")
    scratch: Scratch | None = Field(None, description="Scratch space; defaults to storage.scratch.")
    training: GroupTraining | None = Field(None, description="Image and command of this group, where they differ "
                                                             "from the stack's training section.")
    shared_fs: bool = Field(False, description="Mount the network's shared file system (networks[].sharedFs) on "
                                               "these nodes, at its mountPath, in the training container too.")
    fabric: FabricChoice = Field(
        "auto", description="Multi-node fabric: efa (AWS), erdma (Alibaba), hcc (Tencent) on the types that have "
                            "one (infra/data/fabric.csv); auto: on for a multi-node training group on such a type; "
                            "none: NCCL over the ordinary network.")
    gpu_health: GpuHealth = Field(default_factory=GpuHealth, description="The GPU boot gate's DCGM diagnostic level.")
    capacity: list[Candidate] = Field(default_factory=list, max_length=16, description="Where else the group may run, in "
                                      "order (docs/capacity.md): the capacity broker moves it to the next with stock.")
    active_candidate: StrictInt = Field(0, ge=0, description="Where the group runs now: 0 = as declared above, k = "
                                        "capacity[k-1]. Set by the capacity broker (python -m infra.capacity).")

    @model_validator(mode="after")
    def _type_or_requirement(self) -> NodeGroup:
        if (self.instance_type is None) == (self.gpu is None):
            raise ValueError("give exactly one of instanceType or gpu (a requirement)")
        return self


def _without_dot_slash(value: object) -> object:
    """`./teams.yaml` is teams.yaml (PROJECT_YAML refuses a part that starts with a dot)."""
    while isinstance(value, str) and value.startswith("./"):
        value = value[2:]
    return value


class KubernetesAccess(SpecModel):
    """How the managed clusters' API servers are reached by whoever runs `pulumi up`, and whether
    they are shared by the teams of a registry."""

    api_access_cidrs: list[Cidr] = Field(
        default_factory=list,
        description="Public API endpoint open only to these CIDRs (operators, CI runners); empty = private only.")
    queues: Annotated[str | None, BeforeValidator(_without_dot_slash)] = Field(
        None, pattern=PROJECT_YAML,
        description="A team registry (teams.yaml, relative to the project): the clusters become shared ones — Kueue, "
                    "a ResourceFlavor per GPU model and market, a ClusterQueue with each shared team's GPU quota, "
                    "and a namespace, LocalQueue and RBAC per team; this stack's own Jobs queue too.")


GpuQuota = dict[Cloud, dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9]+$")], Annotated[StrictInt, Field(ge=0)]]]


def quota_of(gpus: GpuQuota, cloud: str) -> dict[str, int]:
    """GPU model -> GPUs of one cloud in a quota (empty where the cloud has none)."""
    return dict(gpus.get(cloud, {}))  # type: ignore[call-overload]  # a str that may not be a Cloud


class TeamLimits(SpecModel):
    """What a team stack may use, from the team registry (written by `make teams`): the policy
    pack holds the stack to it, and the plan and `make teams` report against it."""

    name: Name = Field(description="The team (teams.yaml).")
    policies: Name = Field(description="The policy-pack settings the team stack starts from: policies/<this>.json.")
    regions: dict[Cloud, list[str]] = Field(min_length=1, description="Regions the team may use, per cloud.")
    gpus: GpuQuota = Field(description="GPU quota per cloud and GPU model (GPUs, not nodes).")
    spot_only: bool = Field(True, description="All GPU capacity is spot, beyond onDemandBaseMax on-demand nodes.")
    on_demand_base_max: StrictInt = Field(0, ge=0, description="On-demand nodes the team may keep, all groups together.")


class Storage(SpecModel):
    bucket_prefix: Name = Field(description="Bucket name prefix; each cloud adds its suffix.")
    scratch: Scratch = Field(default_factory=Scratch, description="Default scratch for node groups.")
    checkpoint_archive_days: StrictInt = Field(30, ge=1, description="Days before checkpoints move to archive storage.")
    noncurrent_expire_days: StrictInt = Field(30, ge=1, description="Days before old object versions are deleted.")
    abort_multipart_days: StrictInt = Field(7, ge=1, description="Days before incomplete multipart uploads are aborted.")
    expected_gb: StrictInt = Field(500, ge=0, description="Bucket size used for the cost summary.")
    dataset_tmpfs_gb: StrictInt = Field(0, ge=0, description="Also cache the dataset in RAM (tmpfs) of this size; 0 = off.")


def _interval(value: object) -> int | Literal["auto"]:
    """checkpointEvery: a whole number of steps above 0, or auto (one message, not one per type)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError("use a whole number of steps above 0, or auto")
    return value


class Training(SpecModel):
    image: str = Field(pattern=IMAGE_REF, description="Base image the stack builds the trainer image from (training/Dockerfile), "
                                   "pinned by digest: NGC PyTorch, or your own image with your code in it (the stack "
                                   "adds the trainer layer: launcher, checkpoint library, contract check).")
    command: Command | None = Field(None, description="Your training command, run by the launcher on every process of every node: `[-m, package.module, args...]`, `[script.py, args...]` or an executable with its arguments. `${NAME}` in an argument expands to a trainer-contract variable (e.g. ${DATA_DIR}, ${CHECKPOINT_URL}). Empty: our trainer with `workload`.")
    prebuilt_images: dict[Cloud, Annotated[str, Field(pattern=IMAGE_REF)]] = Field(
        default_factory=dict, description="Per cloud, a trainer image built elsewhere (pinned by digest) to use "
                                          "instead of building one.")
    launcher: Literal["torchrun", "accelerate", "horovod"] = Field("torchrun", description="Distributed launcher.")
    workload: Literal["resnet50", "tiny"] = Field("resnet50", description="Workload the bootstrap trains.")
    steps: StrictInt = Field(100_000, gt=0, description="Optimizer steps of the whole run (across restarts).")
    checkpoint_every: Annotated[int | Literal["auto"], PlainValidator(_interval)] = Field(
        500, description="Checkpoint every N steps (and on SIGTERM), or auto: Daly's interval from the checkpoint cost "
                         "the trainer measures and the group's reclaim rate and notice (training/goodput.py).")
    keep_checkpoints: StrictInt = Field(3, ge=1, description="Checkpoints kept locally and in the bucket.")
    # The peer tier (docs/recovery.md): the bounds are the node's own check's (training/contract.py RECOVERY_LEAST).
    peer_every: StrictInt = Field(0, ge=0, le=86400, description="Steps between in-memory copies of each rank's state "
                                  "on another node of the run (the peer tier, docs/recovery.md): a lost node then costs "
                                  "at most this many steps and a restore from memory, not the bucket. 0: off. Multi-node "
                                  "groups only; each copy blocks the loop for about a memcpy of the state.")
    peer_holders: StrictInt = Field(1, ge=1, le=86400, description="Other nodes holding each node's sharded peer "
                                    "copies: 2 keeps a step through a node lost with its buddy, at one more node's "
                                    "shards in each node's memory and one more send per copy.")
    peer_store_gib: StrictInt = Field(0, ge=0, le=86400, description="GiB of host memory each node's peer store may "
                                      "hold (a copy over it is refused and the sender says so); 0: half the node's "
                                      "memory (or of a Job pod's memory limit).")
    dataset: Name | None = Field(None, description="Dataset name: each cloud's nodes read <bucket>/datasets/<name>/ "
                                                   "in their own cloud.")
    dataset_source: str | None = Field(None, description="Where the dataset's original lives (s3://, oss://, cosn://, "
                                                         "file:// or a path); `make dataset` copies it into each "
                                                         "cloud's bucket.")
    mlflow_tracking_uri: str | None = Field(None, pattern=TRACKING_URI, description="MLflow server, if any.")
    rendezvous_endpoint: str | None = Field(
        None, pattern=r"^[A-Za-z0-9.-]+:\d+$",
        description="host:port of the c10d rendezvous for multi-node VM fleets (e.g. a fixed private IP or DNS name).")


class Budget(SpecModel):
    monthly_limit_usd: Amount = Field(gt=0, description="Monthly spending limit, USD.")
    alert_emails: list[Annotated[str, Field(pattern=EMAIL)]] = Field(
        min_length=1, description="Who gets budget alerts.")
    thresholds_percent: list[Annotated[StrictInt, Field(gt=0, le=200)]] = Field(
        default_factory=lambda: [50, 80, 100], min_length=1,
        description="Alert at these percentages of the limit (at least one: an empty list would alert nobody).")


class PriceOverride(SpecModel):
    cloud: Cloud = Field(description="Cloud of the catalog row the price replaces.")
    instance_type: str = Field(description="Instance type of the catalog row the price replaces.")
    region: str | None = Field(None, description="The region the price is for; none: every region the catalog "
                                                 "prices the type in (give one to price a new region).")
    on_demand_hourly: Amount = Field(gt=0, description="Price per node-hour in the catalog row's currency.")


class Pricing(SpecModel):
    cny_per_usd: Amount = Field(7.2, gt=0, description="Exchange rate for CNY catalog prices.")
    overrides: list[PriceOverride] = Field(default_factory=list, description="Negotiated or current prices.")
    allow_stale_prices: bool = Field(False, description="No prices-fresh verdict on the age of the catalog prices "
                                                        "(otherwise the policy pack's, advisory by default: run "
                                                        "`make prices`).")


class StackSpec(SpecModel):
    """Everything a stack is: clouds, networks, GPU node groups, storage, training, budget, tags."""

    env: Name = Field(description="Environment name: dev, prod, or a team's own.")
    protect_stateful: bool | None = Field(
        None, description="Register buckets, keys, clusters and registries with `protect` (and buckets and keys "
                          "with retainOnDelete): `pulumi destroy` and replacements stop at them. Default: on in prod.")
    team: TeamLimits | None = Field(None, description="Set by `make teams` in a team's generated stack: the team's "
                                                      "regions, GPU quota and markets from teams.yaml.")
    tags: dict[str, str] = Field(description="Tags on every taggable resource; owner, cost-center, env required.")
    clouds: dict[Cloud, CloudAccount] = Field(min_length=1, description="Cloud accounts to deploy into.")
    networks: list[Network] = Field(min_length=1, description="VPCs.")
    peerings: list[Peering] = Field(default_factory=list, description="Links between VPCs.")
    node_groups: list[NodeGroup] = Field(min_length=1, description="GPU node groups.")
    kubernetes: KubernetesAccess = Field(default_factory=KubernetesAccess,
                                         description="API server access of the managed clusters.")
    storage: Storage = Field(description="Bucket and scratch settings.")
    training: Training = Field(description="The training job.")
    budget: Budget = Field(description="Monthly budget and alerts.")
    pricing: Pricing = Field(default_factory=Pricing, description="Exchange rate and price overrides.")

    # Derived lookups -----------------------------------------------------------------
    @property
    def team_name(self) -> str:
        """Whose stack this is, for showback: the registry's team, else the team tag, else the owner."""
        return self.team.name if self.team else self.tags.get("team", self.tags.get("owner", self.env))

    def network(self, name: str) -> Network:
        return next(n for n in self.networks if n.name == name)

    def region_of(self, net: Network) -> str:
        return net.region or self.clouds[net.cloud].region

    def scratch_of(self, group: NodeGroup) -> Scratch:
        return group.scratch or self.storage.scratch

    def shared_fs_of(self, group: NodeGroup) -> SharedFs | None:
        """The shared file system the group mounts, if it asks for one."""
        return self.network(group.network).shared_fs if group.shared_fs else None

    def command_of(self, group: NodeGroup) -> list[str] | None:
        """The group's training command: its own, else the stack's, else None (our trainer)."""
        own = group.training.command if group.training else None
        return own or self.training.command

    def base_image_of(self, group: NodeGroup) -> str:
        """The base image of the group's trainer image: its own, else the stack's."""
        own = group.training.image if group.training else None
        return own or self.training.image

    def catalog(self) -> cat.Catalog:
        overrides: dict[tuple[str, str, str | None], float] = {
            (o.cloud, o.instance_type, o.region): o.on_demand_hourly for o in self.pricing.overrides}
        return cat.load_catalog().with_prices(overrides)
