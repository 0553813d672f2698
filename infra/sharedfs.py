"""Shared file systems (networks[].sharedFs), the cloud-neutral part: which cloud offers which
type, how a node mounts each (the VM bootstrap's gts-shared.sh and a Kubernetes PersistentVolume
read the same values), what the spec may ask for, and what it costs. Each cloud's module
creates the file system, its mount targets and access rules (infra/clouds/<cloud>/sharedfs.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import posixpath

import pulumi

from infra import catalog as cat
from infra.clouds import profiles
from infra.errors import Problem
from infra.spec import SharedFs, StackSpec

CLOUD_OF = {t: p.name for p in profiles() for t in p.shared_fs_types}  # infra/clouds/<cloud>/profile.py
# The mount each type takes: the kernel file system and its options. NFS options are the clouds'
# own recommendations (EFS: docs.aws.amazon.com/efs/latest/ug/mounting-fs-nfs-mount-settings.html;
# NAS: help.aliyun.com "Mount an NFS file system on a Linux ECS instance"; CFS: cloud.tencent.com
# "Using CFS on Linux clients"); _netdev orders the mount after the network.
# EFS mounts through AWS's mount helper (amazon-efs-utils, `mount -t efs`): `tls` wraps NFS in TLS
# (stunnel to the mount target), `iam` signs the mount with the node's role, and the access
# point (`accesspoint=fsap-…`, added per file system) fixes the POSIX user and root directory
# (EFS user guide: mounting-fs-mount-helper-ec2-linux, efs-access-points, encryption-in-transit;
# the file-system policy refuses anything else, infra/clouds/aws/sharedfs.py).
MOUNTS = {
    "efs": ("efs", "tls,iam,_netdev"),
    "fsx-lustre": ("lustre", "relatime,flock,_netdev"),
    "nas": ("nfs", "vers=3,nolock,proto=tcp,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev"),
    "cfs": ("nfs", "vers=3,nolock,proto=tcp,hard,timeo=600,retrans=2,noresvport,_netdev"),
}
# Kubernetes mounts the NFS types through a PersistentVolume; Lustre needs the FSx CSI driver,
# which the stack does not install.
KUBERNETES_TYPES = ("efs", "nas", "cfs")
# FSx for Lustre PERSISTENT_2 capacity: 1200 GiB, 2400 GiB, then multiples of 2400 GiB
# (aws.fsx.LustreFileSystem storage_capacity; FSx API CreateFileSystem StorageCapacity).
FSX_STEPS_GB = 2400
# Where a mount would hide the system, the image (/opt/gts holds the trainer), the node's own
# mounts (/mnt: the dataset's RAM cache; /opt/dlami: the DLAMI's NVMe) or scratch.
RESERVED_DIRS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt",
                 "/opt", "/proc", "/root", "/run", "/sbin", "/scratch", "/snap", "/srv", "/sys", "/tmp", "/usr",
                 "/var")


@dataclass(frozen=True)
class SharedMount:
    """How a node mounts one shared file system: `mount -t <fs_type> -o <options> <source> <path>`."""

    fs_type: str
    source: str  # server:/path (NFS) or dns@tcp:/mountname (Lustre)
    options: str
    path: str


@dataclass
class SharedFsOutputs:
    """What a cloud's shared file system hands the nodes: the mount source once it is known, and
    the NFS server and export path a Kubernetes PersistentVolume names."""

    spec: SharedFs
    source: pulumi.Output[str]
    server: pulumi.Output[str]
    export: pulumi.Output[str]
    # EFS: the file system's id and the access point every mount goes through (the CSI driver's
    # volumeHandle is `<fs id>::<access point id>`)
    file_system_id: pulumi.Output[str] | None = None
    access_point: pulumi.Output[str] | None = None

    def mount(self) -> pulumi.Output[SharedMount]:
        fs_type, options = MOUNTS[self.spec.type]
        point = self.access_point if self.access_point is not None else pulumi.Output.from_input("")
        return pulumi.Output.all(self.source, point).apply(lambda sp: SharedMount(
            fs_type, str(sp[0]), options + (f",accesspoint={sp[1]}" if sp[1] else ""), self.spec.mount_path))


def placeholder(shared: SharedFs) -> SharedMount:
    """The mount as `make userdata` shows it before the file system exists (sized like a real one)."""
    fs_type, options = MOUNTS[shared.type]
    if shared.type == "efs":
        options += ",accesspoint=fsap-0123456789abcdef0"
    # as long as the longest real address (an EFS or FSx name in the longest region name), so that
    # the user data size checked at plan time is not exceeded once the real address is known
    long_name = "fs-0123456789abcdef0.file-system.ap-southeast-5-example.amazonaws.com"
    source = {"fsx-lustre": f"{long_name}@tcp:/abcdefgh", "cfs": "255.255.255.255:/abcdefgh"}.get(
        shared.type, f"{long_name}:/")
    return SharedMount(fs_type, source, options, shared.mount_path)


def check(spec: StackSpec) -> Iterator[Problem]:
    """What a stack may ask of its shared file systems."""
    for i, net in enumerate(spec.networks):
        fs = net.shared_fs
        if fs is None:
            continue
        key = f"networks[{i}].sharedFs"
        if CLOUD_OF[fs.type] != net.cloud:
            offered = sorted(t for t, c in CLOUD_OF.items() if c == net.cloud)
            yield Problem(f"{key}.type", f"{fs.type!r} is not offered on {cat.CLOUD_NAMES[net.cloud]}; use "
                                         f"{' or '.join(offered)}")
        if fs.type == "fsx-lustre" and fs.size_gb not in (1200, 2400) and fs.size_gb % FSX_STEPS_GB:
            yield Problem(f"{key}.sizeGb", f"FSx for Lustre takes 1200, 2400 or a multiple of {FSX_STEPS_GB} GB, "
                                           f"not {fs.size_gb}")
        if fs.performance and fs.type not in ("nas", "cfs"):
            yield Problem(f"{key}.performance", f"applies to nas and cfs; {fs.type} sets its throughput otherwise")
        path = fs.mount_path
        if posixpath.normpath(path) != path or "//" in path:
            yield Problem(f"{key}.mountPath", f"{path!r} is not a plain absolute path (no '.', '..' or '//' parts); "
                                              "use e.g. /shared")
        elif any(path == d or path.startswith(d + "/") for d in RESERVED_DIRS):
            yield Problem(f"{key}.mountPath", f"{path} would hide a system, image, node or scratch directory; use a "
                                              "new top-level directory such as /shared")
    for i, group in enumerate(spec.node_groups):
        if not group.shared_fs:
            continue
        fs = spec.network(group.network).shared_fs
        if fs is None:
            yield Problem(f"nodeGroups[{i}].sharedFs", f"network {group.network} has no sharedFs; add one to it "
                                                        "or set sharedFs: false")
        elif group.kind == "kubernetes" and fs.type not in KUBERNETES_TYPES:
            yield Problem(f"nodeGroups[{i}].sharedFs", f"{fs.type} mounts on VM groups only here (pods would need "
                                                        "the FSx CSI driver); use efs for Kubernetes groups")


def monthly_usd(spec: StackSpec, cloud: str) -> float:
    """The shared file systems of this cloud's networks, per month (USD)."""
    prices = cat.load_storage_prices()[cloud]
    total = 0.0
    for net in spec.networks:
        fs = net.shared_fs
        if net.cloud != cloud or fs is None:
            continue
        key = fs.type + ("-performance" if fs.performance else "")
        if fs.type == "fsx-lustre":
            key = f"fsx-lustre-{fs.throughput_per_tib}"
        per_gb = float(prices["sharedFs"][key])
        total += fs.size_gb * per_gb
    return total / spec.pricing.cny_per_usd if prices["currency"] == "CNY" else total
