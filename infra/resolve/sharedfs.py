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

from infra.clouds import profiles, shared_fs
from infra.clouds.profile import SharedFsKind
from infra.core import catalog as cat
from infra.core.errors import Problem
from infra.model.spec import SharedFs, StackSpec

CLOUD_OF = {t: p.name for p in profiles() for t in p.shared_fs_types}  # infra/clouds/<cloud>/profile.py
# Each type's mount, what pods need and what the stack checks of it are its cloud's answers
# (infra/clouds/<cloud>/profile.py shared_fs_kinds); the NFS options are the clouds' own
# recommendations, with their sources there.
PERFORMANCE_TYPES = tuple(k.type for p in profiles() for k in p.shared_fs_kinds if k.performance)
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

    @property
    def kind(self) -> SharedFsKind:
        return kind_of(self.spec)

    def mount(self) -> pulumi.Output[SharedMount]:
        k = self.kind
        point = self.access_point if self.access_point is not None else pulumi.Output.from_input("")
        return pulumi.Output.all(self.source, point).apply(lambda sp: SharedMount(
            k.mount_type, str(sp[0]), k.options + (f",accesspoint={sp[1]}" if sp[1] else ""), self.spec.mount_path))


def kind_of(shared: SharedFs) -> SharedFsKind:
    """How the file system's type mounts, as its cloud answers (infra/clouds/<cloud>/profile.py)."""
    return shared_fs(shared.type)[1]


def placeholder(shared: SharedFs) -> SharedMount:
    """The mount as `make userdata` shows it before the file system exists (sized like a real one)."""
    k = kind_of(shared)
    options = k.options + (f",accesspoint={k.access_point}" if k.access_point else "")
    # as long as the longest real address (an EFS or FSx name in the longest region name), so that
    # the user data size checked at plan time is not exceeded once the real address is known
    long_name = "fs-0123456789abcdef0.file-system.ap-southeast-5-example.amazonaws.com"
    return SharedMount(k.mount_type, k.placeholder_source.format(host=long_name), options, shared.mount_path)


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
        k = kind_of(fs)
        if k.size_step_gb and fs.size_gb not in k.sizes_gb and fs.size_gb % k.size_step_gb:
            yield Problem(f"{key}.sizeGb", f"{k.title} takes {', '.join(map(str, k.sizes_gb))} or a multiple of "
                                           f"{k.size_step_gb} GB, not {fs.size_gb}")
        if fs.performance and not k.performance:
            yield Problem(f"{key}.performance", f"applies to {' and '.join(PERFORMANCE_TYPES)}; {fs.type} sets its "
                                                "throughput otherwise")
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
        elif group.kind == "kubernetes" and (need := kind_of(fs).pods_would_need):
            on_pods = [k.type for k in shared_fs(fs.type)[0].shared_fs_kinds if not k.pods_would_need]
            yield Problem(f"nodeGroups[{i}].sharedFs", f"{fs.type} mounts on VM groups only here (pods would need "
                                                        f"{need}); use {' or '.join(on_pods)} for Kubernetes groups")


def monthly_usd(spec: StackSpec, cloud: str) -> float:
    """The shared file systems of this cloud's networks, per month (USD)."""
    prices = cat.load_storage_prices()[cloud]
    total = 0.0
    for net in spec.networks:
        fs = net.shared_fs
        if net.cloud != cloud or fs is None:
            continue
        key = fs.type + ("-performance" if fs.performance else "")
        if kind_of(fs).priced_by_throughput:
            key = f"{fs.type}-{fs.throughput_per_tib}"
        per_gb = float(prices["sharedFs"][key])
        total += fs.size_gb * per_gb
    return total / spec.pricing.cny_per_usd if prices["currency"] == "CNY" else total
