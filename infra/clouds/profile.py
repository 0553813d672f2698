"""What the rest of infra/ may ask of a cloud, in one place: `CloudProfile`.

Each cloud answers in its own `infra/clouds/<cloud>/profile.py`; `infra.clouds.profile(name)`
finds it (and refuses a name it does not know). Every question is abstract, so a cloud that
leaves one out cannot be instantiated: there is no default to fall through to.

A profile is plain data and small pure functions: it imports nothing of the project but this
module, so any module (the spec included) can ask it without an import cycle. What needs the
provider SDKs stays in the cloud's other modules (platform.py, fleet.py, ...), which the
profile names by import path.
"""

from __future__ import annotations

import abc
import ipaddress
from dataclasses import dataclass
from typing import Literal, Protocol

Counted = Literal["raw", "base64"]


class MarketAnswers(Protocol):
    """What a profile asks of a group's market; infra/model/spec_capacity.py's Market answers it (the
    profile compares no market's name, and imports no spec)."""

    @property
    def spot(self) -> bool: ...

    @property
    def prepaid(self) -> bool: ...

    @property
    def on_demand_base(self) -> int: ...


@dataclass(frozen=True)
class DiskEncryption:
    """How the policy pack tells that a dataDisks[] item of this cloud's instances, scaling
    configurations and node pools is encrypted."""

    key: str  # the item's key that encrypts the disk
    encrypted: tuple[bool | str, ...]  # the values of it that count as encrypted (a bool by identity)
    # The pinned SDK may lack the key for some resource types (data/capabilities.yaml sdkGaps
    # "dataDiskEncryption"), and the disks may sit in autoScalingConfig.dataDisks instead.
    sdk_gap_possible: bool


@dataclass(frozen=True)
class SharedFsKind:
    """One shared file system a cloud offers (a networks[].sharedFs.type value): how a node mounts
    it (the VM bootstrap's gts-shared.sh and a Kubernetes PersistentVolume read the same values),
    whether pods can, what the stack checks of its size, and how it is priced (infra/resolve/sharedfs.py
    asks these; it compares no type's name)."""

    type: str  # the sharedFs.type value
    mount_type: str  # the kernel file system `mount -t` takes
    options: str  # its mount options
    # The mount source `make userdata` shows before the file system exists, sized like the longest
    # real one ({host}: the longest DNS name a real one can have)
    placeholder_source: str
    # Mounts go through a per-file-system access point (this is a placeholder id of one): the
    # access point owns the root for the trainer's uid, so no node prepares it. "": no access point.
    access_point: str = ""
    csi_driver: str = ""  # pods mount it through this CSI driver ("": a PersistentVolume naming the NFS server)
    csi_attributes: tuple[tuple[str, str], ...] = ()  # the CSI volume's attributes
    pods_would_need: str = ""  # what pods would need to mount it ("": they can; else VM groups only)
    performance: bool = False  # it takes sharedFs.performance (a performance class)
    title: str = ""  # how the size message names it
    sizes_gb: tuple[int, ...] = ()  # the sizes it takes below multiples of size_step_gb
    size_step_gb: int = 0  # its provisioned capacity's step (0: it grows as used, the size is priced)
    priced_by_throughput: bool = False  # its price row is <type>-<throughputPerTib>


class CloudProfile(abc.ABC):
    """One cloud's answers. Subclasses are frozen singletons built by `infra.clouds`."""

    # -- who it is ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The key in stack files (`clouds.<name>`, `nodeGroups[].cloud`, data files' cloud column)."""

    @property
    @abc.abstractmethod
    def display_name(self) -> str:
        """How messages name it ("Tencent Cloud")."""

    @property
    @abc.abstractmethod
    def provider(self) -> str:
        """The Pulumi provider's config namespace and resource type-token prefix."""

    @property
    @abc.abstractmethod
    def sdk_package(self) -> str:
        """The Python package of that provider's SDK."""

    @property
    @abc.abstractmethod
    def platform(self) -> str:
        """`module:Class` of the cloud's platform component (infra/clouds/<cloud>/platform.py)."""

    @abc.abstractmethod
    def fixed_instances(self, nodes: int, market: MarketAnswers, fabric: bool) -> int:
        """How many of a VM group's `nodes` (scaling.max) are fixed instances outside any scaling
        group (`fabric`: the group has a multi-node fabric), as the cloud's fleet builds them (infra/clouds/<cloud>/fleet.py asks it too): plain
        arithmetic, so the checks and the GPU watch's mode ask it without loading resource code."""

    @property
    def stock_module(self) -> str:
        """The module asking the cloud's own API for stock, quota and launch failures
        (infra/clouds/<cloud>/stock.py; the interface: infra/capacity/stock.py)."""
        return f"infra.clouds.{self.name}.stock"

    @property
    @abc.abstractmethod
    def mocks_module(self) -> str:
        """The module whose INVOKES and COMPUTED answer the mock engine for this cloud's provider
        (`make plan`, the tests; gathered by infra/plan/invokes.py)."""

    # -- object storage -------------------------------------------------------------
    @property
    @abc.abstractmethod
    def storage_scheme(self) -> str:
        """The URL scheme the trainer's storage layer (training/ckpt/storage.py) reads for this cloud."""

    @abc.abstractmethod
    def bucket_name(self, prefix: str, region: str, app_id: int | str | None) -> str:
        """The stack's bucket in a region (its name is global, so the region is in it)."""

    @abc.abstractmethod
    def storage_endpoint(self, bucket_region: str, node_region: str) -> str:
        """The S3-compatible endpoint a node in node_region reaches the bucket through."""

    @property
    @abc.abstractmethod
    def app_id_missing(self) -> str | None:
        """The message for `clouds.<name>.appId` when the account needs one and has none (None: not needed)."""

    # -- the node's metadata service and credentials ----------------------------------
    @property
    @abc.abstractmethod
    def metadata_url(self) -> str:
        """The instance metadata service's base URL (training/cloudmeta.py reads the same)."""

    @abc.abstractmethod
    def storage_credentials(self, kind: str) -> str:
        """Where a node of this kind ("vm" or "kubernetes") takes its storage credentials from
        (the STORAGE_CREDENTIALS value training/credentials.py reads)."""

    @property
    @abc.abstractmethod
    def sets_aws_region(self) -> bool:
        """Whether the node's SDK reads its region from AWS_REGION (the contract sets it)."""

    @property
    @abc.abstractmethod
    def operator_keys(self) -> tuple[str, str] | None:
        """The environment variables holding an operator's access key pair (None: the SDK's own chain)."""

    @property
    @abc.abstractmethod
    def instance_tags_in_metadata(self) -> bool:
        """Whether VM instance tags are served by the metadata service (their keys are then restricted)."""

    # -- networks -------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def subnet_word(self) -> str:
        """What the cloud calls a subnet ("vSwitch")."""

    @property
    @abc.abstractmethod
    def stores_own_subnet(self) -> bool:
        """Whether the rendezvous stores get a subnet of their own (else a range of the first one)."""

    @property
    @abc.abstractmethod
    def store_subnet_clear_of(self) -> str:
        """What the stores' own subnet keeps clear of, for the message when there is no room."""

    @property
    @abc.abstractmethod
    def vpc_prefix_floor_192(self) -> int | None:
        """The shortest prefix a VPC inside 192.168.0.0/16 may have, where the cloud narrows it."""

    @abc.abstractmethod
    def kubernetes_pod_subnets(self, vpc: ipaddress.IPv4Network,
                               subnets: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
        """The VPC ranges a cluster's pods take besides the node subnets, one per subnet while
        there is room (empty where pods take cluster-wide ranges outside the VPC)."""

    # -- registry -------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def registry_regional(self) -> bool:
        """Whether the stack's registry serves VPCs of its home region only and is closed to the
        internet except for kubernetes.apiAccessCidrs."""

    # -- multi-node fabric ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def fabric(self) -> str:
        """The fabric kind of its multi-node types (infra/data/fabric.csv): efa, erdma or hcc."""

    @property
    @abc.abstractmethod
    def plain_network(self) -> str:
        """What a node's ordinary network gives NCCL instead of the fabric."""

    @abc.abstractmethod
    def fabric_placement(self, kind: str, market: MarketAnswers) -> str:
        """What keeps a fabric group's nodes together."""

    @property
    @abc.abstractmethod
    def placement_monthly_usd(self) -> float:
        """What that placement resource costs a month."""

    @abc.abstractmethod
    def fabric_unbuildable(self, kind: str, market: MarketAnswers) -> str | None:
        """Why the stack cannot give a group of this kind and market the fabric, or None."""

    @property
    @abc.abstractmethod
    def fabric_name(self) -> str:
        """What messages call the fabric ("EFA (Elastic Fabric Adapter)")."""

    @abc.abstractmethod
    def fabric_row_problem(self, interfaces: int, devices: int, primary_every: int) -> str | None:
        """What is wrong with a fabric.csv row of this cloud (its interfaces, devices and
        efa_primary_every columns), or None."""

    @abc.abstractmethod
    def fabric_fixed_count(self, nodes: int) -> str | None:
        """Why a fabric group of this many nodes is a fixed count with no range or schedule (the
        start of the message), or None where it scales."""

    @abc.abstractmethod
    def fabric_env(self, kind: str, vpc_cidr: str) -> dict[str, str]:
        """The NCCL / libfabric settings a node of this kind ("vm" or "kubernetes") in a network of
        this CIDR gets for the fabric, by training/contract.py FABRIC_VARS name, in order."""

    @abc.abstractmethod
    def fabric_pod_resources(self, devices: int) -> dict[str, str]:
        """What a trainer pod requests for a node's fabric devices (the extended resource its device
        plugin advertises, and what the devices need); empty where pods get no fabric."""

    @property
    @abc.abstractmethod
    def fabric_device_plugin(self) -> str | None:
        """The image of the device plugin DaemonSet the stack runs on a cluster's fabric groups to
        advertise that resource (its repository's last part names the DaemonSet); None: the
        cloud's own add-on advertises it, or its pools get no fabric."""

    # -- Kubernetes -----------------------------------------------------------------
    @property
    @abc.abstractmethod
    def kubernetes_service(self) -> str:
        """The managed Kubernetes service's name in messages (EKS, ACK, TKE)."""

    @property
    @abc.abstractmethod
    def kubernetes_pods_in_vpc(self) -> bool:
        """Whether pods take VPC addresses (else cluster pod/service ranges that must not overlap a VPC)."""

    @property
    @abc.abstractmethod
    def kubernetes_pool_marks_rule(self) -> str | None:
        """The infra/data/constraints.yaml key bounding a pool's tags + labels + taints, if any."""

    @property
    @abc.abstractmethod
    def kubernetes_pool_mixes_markets(self) -> bool:
        """Whether one node pool holds a spot group's on-demand base and its spot nodes together."""

    @property
    @abc.abstractmethod
    def multi_node_one_zone(self) -> bool:
        """Whether a multi-node VM training group keeps to one zone (its network's first subnet)
        without a fabric too (AWS: its cluster placement group, which AWS confines to one zone)."""

    @property
    @abc.abstractmethod
    def kubernetes_job_success_policy(self) -> bool:
        """Whether the cloud's clusters run a Kubernetes with the Job success policy (KEP-3998, GA 1.33)."""

    @property
    @abc.abstractmethod
    def kubernetes_nodeadm(self) -> bool:
        """Whether pool nodes take a MIME NodeConfig user data (EKS nodeadm) rather than a script."""

    @property
    @abc.abstractmethod
    def pod_identity_egress(self) -> tuple[str, ...]:
        """What a pod's own identity needs in the link-local metadata range."""

    # -- user data ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def user_data_limit(self) -> tuple[int, Counted]:
        """The user data field's size limit: bytes, counted on the raw text or its base64 form."""

    @property
    @abc.abstractmethod
    def kubernetes_user_data_limit(self) -> tuple[int, Counted] | None:
        """A smaller limit for cluster pool nodes where the service adds its own part (None: the same)."""

    # -- scheduled scaling ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def schedules_in_beijing_time(self) -> bool:
        """Whether scheduled scaling actions take their recurrence in Beijing time (UTC+8)."""

    # -- shared file systems and prices -----------------------------------------------
    @property
    @abc.abstractmethod
    def shared_fs_kinds(self) -> tuple[SharedFsKind, ...]:
        """The shared file systems this cloud offers, each with how it mounts."""

    @property
    def shared_fs_types(self) -> tuple[str, ...]:
        """The sharedFs.type values this cloud offers."""
        return tuple(k.type for k in self.shared_fs_kinds)

    @property
    @abc.abstractmethod
    def price_refresh(self) -> str:
        """`module:function` refreshing this cloud's rows of infra/data/prices.csv from its price API."""

    # -- the policy pack (it cannot import infra/: policies/data/clouds.yaml is written from these)
    @property
    @abc.abstractmethod
    def instance_passwords(self) -> bool:
        """Its instances take a login password argument (the pack refuses one being set)."""

    @property
    @abc.abstractmethod
    def disk_encryption(self) -> DiskEncryption | None:
        """How its data disks say they are encrypted; None: the pack checks each resource type."""
