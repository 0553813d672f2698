"""Alibaba Cloud: a general-purpose NAS file system (NFS) with one mount target in the network's
first vSwitch, behind its own VPC permission group: one read-write rule per CIDR of the stack
that may reach it (the network and its peers). Without a group of its own a mount target takes
DEFAULT_VPC_GROUP_NAME, which admits the whole VPC; access is by client address, not security
group. Encrypted at rest with the NAS-managed key (encrypt_type 1: a KMS key of one's own is for
Extreme NAS only).

Checked against pulumi-alicloud 4.0.0 (nas/file_system.py, nas/access_group.py,
nas/access_rule.py, nas/mount_target.py) and terraform-provider-alicloud
resource_alicloud_nas_*.go: protocol_type, storage_type (Performance | Capacity), file_system_type,
encrypt_type and zone_id force replacement; access_group_name / access_group_type replace the
deprecated name / type; rw_access_type RDWR | RDONLY; user_access_type no_squash | root_squash |
all_squash; priority 1-100 (1 first). NFS v3 and v4.0 only (no 4.1). CPFS is not offered: it needs
its own client on every node and cannot be encrypted through encrypt_type."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.image import registry_name
from infra.model.spec import Network
from infra.resolve.sharedfs import SharedFsOutputs


@dataclass
class AlicloudSharedFsArgs:
    env: str
    network: Network
    vswitch_id: pulumi.Output[str]
    zone: str
    allowed_cidrs: list[str]
    tags: dict[str, str]


class AlicloudSharedFs(pulumi.ComponentResource):
    outputs: SharedFsOutputs

    def __init__(self, name: str, args: AlicloudSharedFsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:SharedFs", name, None, opts)
        fs = args.network.shared_fs
        assert fs is not None
        child = pulumi.ResourceOptions(parent=self)
        # The group's name is its identity in the region: unique per stack (as the registry's is).
        group = alicloud.nas.AccessGroup(f"{name}-access", access_group_name=f"{registry_name(args.env)}-{name}",
                                         access_group_type="Vpc", file_system_type="standard",
                                         description="gpu-training-stack: the stack's networks only", opts=child)
        # no_squash: the node hands the file system's root to the trainer's uid (gts-shared.sh).
        # One priority for all: every rule grants the same, so which of them matches does not matter.
        rules = [alicloud.nas.AccessRule(f"{name}-rule-{i}", access_group_name=group.access_group_name,
                                         source_cidr_ip=cidr, rw_access_type="RDWR", user_access_type="no_squash",
                                         priority=1, file_system_type="standard", opts=child)
                 for i, cidr in enumerate(args.allowed_cidrs)]
        self.file_system = alicloud.nas.FileSystem(
            f"{name}-nas", protocol_type="NFS", storage_type="Performance" if fs.performance else "Capacity",
            file_system_type="standard", encrypt_type=1, zone_id=args.zone,
            description=f"gpu-training-stack {name} shared", tags=args.tags, opts=child)
        self.mount_target = alicloud.nas.MountTarget(
            f"{name}-mount", file_system_id=self.file_system.id, access_group_name=group.access_group_name,
            vswitch_id=args.vswitch_id, network_type="Vpc",
            opts=pulumi.ResourceOptions(parent=self, depends_on=rules))
        domain = self.mount_target.mount_target_domain
        self.outputs = SharedFsOutputs(spec=fs, server=domain, export=pulumi.Output.from_input("/"),
                                       source=domain.apply(lambda d: f"{d}:/"))
        self.register_outputs({"fileSystemId": self.file_system.id, "mountTargetDomain": domain})
