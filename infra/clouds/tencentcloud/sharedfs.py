"""Tencent Cloud: a CFS file system (NFS, general series) in one subnet of the network, with its
own permission group: one read-write rule per CIDR of the stack that may reach it (the network
and its peers). A permission group without rules admits every client, so the rules are made with
the group; the file system takes no security group (access is by client address).

Checked against tencentcloud-iac-pulumi 0.2.3 (cfs/file_system.py, cfs/access_group.py,
cfs/access_rule.py) and terraform-provider-tencentcloud services/cfs/resource_tc_cfs_*.go:
availability_zone, protocol, storage_type (SD | HP), vpc_id and subnet_id force replacement;
access rules default to read-only and root_squash; priority 1-100. Encryption at rest: the CFS
API has no input for it, and the service encrypts only the Turbo series, chosen in the console
(the policy pack says so as an advisory)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.model.spec import Network
from infra.resolve.sharedfs import SharedFsOutputs


@dataclass
class TencentSharedFsArgs:
    network: Network
    vpc_id: pulumi.Output[str]
    subnet_id: pulumi.Output[str]
    zone: str
    allowed_cidrs: list[str]
    tags: dict[str, str]


class TencentSharedFs(pulumi.ComponentResource):
    outputs: SharedFsOutputs

    def __init__(self, name: str, args: TencentSharedFsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:SharedFs", name, None, opts)
        fs = args.network.shared_fs
        assert fs is not None
        child = pulumi.ResourceOptions(parent=self)
        # A label, not an identity (unlike a NAS group's name, infra/clouds/alicloud/sharedfs.py):
        # CFS creates the group by name and addresses it by the id it returns, and nothing asks
        # for unique names (terraform-provider-tencentcloud resource_tc_cfs_access_group.go).
        group = tencentcloud.cfs.AccessGroup(f"{name}-access", name=f"{name}-shared",
                                             description="gpu-training-stack: the stack's networks only", opts=child)
        # no_root_squash: the node hands the file system's root to the trainer's uid (gts-shared.sh).
        # Distinct priorities: among overlapping rules of one priority CFS applies one at random
        # (qcloud-documents 权限组); distinct ones keep the match defined, though every rule grants the same.
        rules = [tencentcloud.cfs.AccessRule(f"{name}-rule-{i}", access_group_id=group.id, auth_client_ip=cidr,
                                             priority=i + 1, rw_permission="RW", user_permission="no_root_squash",
                                             opts=child)
                 for i, cidr in enumerate(args.allowed_cidrs)]
        self.file_system = tencentcloud.cfs.FileSystem(
            f"{name}-cfs", name=f"{name}-shared", availability_zone=args.zone, access_group_id=group.id,
            protocol="NFS", storage_type="HP" if fs.performance else "SD", vpc_id=args.vpc_id,
            subnet_id=args.subnet_id, tags=args.tags, opts=pulumi.ResourceOptions(parent=self, depends_on=rules))
        # NFS v3 exports the file system under /<fs_id> (Tencent's advice for container clients).
        export = self.file_system.fs_id.apply(lambda fsid: f"/{fsid}")
        self.outputs = SharedFsOutputs(
            spec=fs, server=self.file_system.mount_ip, export=export,
            source=pulumi.Output.all(self.file_system.mount_ip, export).apply(lambda ie: f"{ie[0]}:{ie[1]}"))
        self.register_outputs({"fileSystemId": self.file_system.id, "mountIp": self.file_system.mount_ip})
