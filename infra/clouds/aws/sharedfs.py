"""AWS: Amazon EFS (NFS 4.1, one mount target per zone of the network) or FSx for Lustre
(PERSISTENT_2, in the network's first subnet), encrypted with the stack's KMS key where the
network is in the key's region (AWS-managed keys elsewhere: KMS keys are regional), behind a
security group of its own that admits the file system's ports from the stack's CIDRs only (the
network and its peers).

Checked against pulumi-aws 7.51.1 (efs/file_system.py, efs/mount_target.py,
fsx/lustre_file_system.py) and terraform-provider-aws (internal/service/efs, internal/service/fsx):
EFS kms_key_id is an ARN and needs encrypted=true; throughput_mode defaults to bursting (set
elastic); one mount target per availability zone (MountTargetConflict otherwise). FSx for Lustre:
subnet_ids is one subnet; deployment_type defaults to SCRATCH_1 (set PERSISTENT_2);
per_unit_storage_throughput 125 | 250 | 500 | 1000 for PERSISTENT_2; kms_key_id only for the
persistent types; file_system_type_version 2.15; storage_capacity 1200, 2400, then multiples of
2400 (infra/resolve/sharedfs.py checks it). Ports: NFS 2049; Lustre 988 and 1018-1023, also among the
file servers themselves (docs.aws.amazon.com/fsx/latest/LustreGuide/limit-access-security-groups.html).

EFS is guarded by more than its security group: an access point (every mount runs as the
trainer's uid in a root directory the access point creates owned by it; EFS user guide,
efs-access-points: "enforce a user identity" and "root directory … CreationInfo"), and a file
system policy (EFS user guide, iam-access-control-nfs-efs and the policy examples there) that
denies any connection without TLS (aws:SecureTransport false) and allows ClientMount and
ClientWrite only to the node roles of the network's groups that mount it, only through that
access point (elasticfilesystem:AccessPointArn). No ClientRootAccess: root on a node is squashed
to nobody. pulumi-aws efs/access_point.py (posix_user uid/gid, root_directory path and
creation_info owner_uid/owner_gid/permissions) and efs/file_system_policy.py (file_system_id,
policy; bypass_policy_lockout_safety_check left false)."""

from __future__ import annotations

from dataclasses import dataclass

import json

import pulumi
import pulumi_aws as aws

from infra.model.spec import Network
from infra.resolve.sharedfs import SharedFsOutputs

TRAINER_UID = 1000  # the image's USER (training/Dockerfile); gts-shared.sh hands other types' roots to it
ROOT_DIRECTORY = "/training"
PORTS = {"efs": [(2049, 2049)], "fsx-lustre": [(988, 988), (1018, 1023)]}


@dataclass
class AwsSharedFsArgs:
    network: Network
    vpc_id: pulumi.Output[str]
    subnet_ids: list[pulumi.Output[str]]  # one per zone, in the spec's order
    allowed_cidrs: list[str]
    kms_key_arn: pulumi.Output[str] | None  # the stack's key, where it is in the network's region
    tags: dict[str, str]


class AwsSharedFs(pulumi.ComponentResource):
    outputs: SharedFsOutputs

    def __init__(self, name: str, args: AwsSharedFsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:SharedFs", name, None, opts)
        fs = args.network.shared_fs
        assert fs is not None
        child = pulumi.ResourceOptions(parent=self)
        tags = {**args.tags, "Name": f"{name}-shared"}
        self.security_group = aws.ec2.SecurityGroup(
            f"{name}-shared-sg", vpc_id=args.vpc_id, description=f"{fs.type}: the stack's networks only",
            tags=tags, opts=child)
        sg = self.security_group.id
        for low, high in PORTS[fs.type]:
            for i, cidr in enumerate(args.allowed_cidrs):
                aws.vpc.SecurityGroupIngressRule(f"{name}-shared-{low}-{i}", security_group_id=sg, cidr_ipv4=cidr,
                                                 ip_protocol="tcp", from_port=low, to_port=high,
                                                 description=f"{fs.type} from the stack", tags=args.tags, opts=child)
            if fs.type == "fsx-lustre":  # the file servers talk to each other on the same ports
                aws.vpc.SecurityGroupIngressRule(f"{name}-shared-{low}-self", security_group_id=sg,
                                                 referenced_security_group_id=sg, ip_protocol="tcp", from_port=low,
                                                 to_port=high, description="Lustre among the file servers",
                                                 tags=args.tags, opts=child)
        # A security group made by the provider has no egress rule (pulumi_aws ec2/security_group.py,
        # "NOTE on Egress rules": it removes AWS's default allow-all); replies need none (stateful), but
        # FSx for Lustre's servers connect to each other: outbound within the network only.
        aws.vpc.SecurityGroupEgressRule(f"{name}-shared-egress", security_group_id=sg, cidr_ipv4=args.allowed_cidrs[0],
                                        ip_protocol="-1", description="file servers among themselves, in the network",
                                        tags=args.tags, opts=child)
        self.outputs = self._efs(name, args, tags, child) if fs.type == "efs" else self._lustre(name, args, tags, child)
        self.register_outputs({"source": self.outputs.source})

    def _efs(self, name: str, args: AwsSharedFsArgs, tags: dict[str, str],
             child: pulumi.ResourceOptions) -> SharedFsOutputs:
        assert args.network.shared_fs is not None
        self.efs = aws.efs.FileSystem(f"{name}-efs", encrypted=True, kms_key_id=args.kms_key_arn,
                                      performance_mode="generalPurpose", throughput_mode="elastic",
                                      lifecycle_policies=[aws.efs.FileSystemLifecyclePolicyArgs(
                                          transition_to_ia="AFTER_30_DAYS")],
                                      tags=tags, opts=child)
        zones = {sub.zone: subnet for sub, subnet in zip(args.network.subnets, args.subnet_ids)}
        self.mount_targets = [aws.efs.MountTarget(f"{name}-efs-{zone}", file_system_id=self.efs.id, subnet_id=subnet,
                                                  security_groups=[self.security_group.id], opts=child)
                              for zone, subnet in zones.items()]
        # The name resolves in the VPC once the zone's mount target exists (gts-shared.sh waits for it).
        dns = pulumi.Output.all(self.efs.dns_name, *[t.id for t in self.mount_targets]).apply(lambda a: str(a[0]))
        self.access_point = aws.efs.AccessPoint(
            f"{name}-efs-ap", file_system_id=self.efs.id,
            posix_user=aws.efs.AccessPointPosixUserArgs(uid=TRAINER_UID, gid=TRAINER_UID),
            root_directory=aws.efs.AccessPointRootDirectoryArgs(
                path=ROOT_DIRECTORY, creation_info=aws.efs.AccessPointRootDirectoryCreationInfoArgs(
                    owner_uid=TRAINER_UID, owner_gid=TRAINER_UID, permissions="0750")),
            tags=tags, opts=child)
        return SharedFsOutputs(spec=args.network.shared_fs, server=dns, export=pulumi.Output.from_input("/"),
                               source=dns.apply(lambda d: f"{d}:/"), file_system_id=self.efs.id,
                               access_point=self.access_point.id)

    def allow(self, name: str, role_arns: list[pulumi.Output[str]]) -> None:
        """The file system policy: TLS always, and mounts and writes only by these roles through
        the access point. A file system with no role that mounts it gets the TLS rule alone."""
        if not hasattr(self, "efs"):
            return
        doc = pulumi.Output.all(self.efs.arn, self.access_point.arn, *role_arns).apply(
            lambda v: efs_policy(str(v[0]), str(v[1]), [str(r) for r in v[2:]]))
        aws.efs.FileSystemPolicy(f"{name}-efs-policy", file_system_id=self.efs.id, policy=doc,
                                 opts=pulumi.ResourceOptions(parent=self))

    def _lustre(self, name: str, args: AwsSharedFsArgs, tags: dict[str, str],
                child: pulumi.ResourceOptions) -> SharedFsOutputs:
        fs = args.network.shared_fs
        assert fs is not None
        self.lustre = aws.fsx.LustreFileSystem(
            f"{name}-lustre", storage_capacity=fs.size_gb, subnet_ids=args.subnet_ids[0],
            deployment_type="PERSISTENT_2", per_unit_storage_throughput=fs.throughput_per_tib,
            kms_key_id=args.kms_key_arn, security_group_ids=[self.security_group.id],
            file_system_type_version="2.15", data_compression_type="LZ4", tags=tags, opts=child)
        source = pulumi.Output.all(self.lustre.dns_name, self.lustre.mount_name).apply(
            lambda dm: f"{dm[0]}@tcp:/{dm[1]}")
        return SharedFsOutputs(spec=fs, server=self.lustre.dns_name, export=self.lustre.mount_name, source=source)


def efs_policy(fs_arn: str, access_point_arn: str, role_arns: list[str]) -> str:
    statements: list[dict[str, object]] = [
        {"Sid": "TlsOnly", "Effect": "Deny", "Principal": {"AWS": "*"}, "Action": "*", "Resource": fs_arn,
         "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]
    if role_arns:
        statements.append({
            "Sid": "GroupNodesThroughAccessPoint", "Effect": "Allow", "Principal": {"AWS": sorted(role_arns)},
            "Action": ["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"], "Resource": fs_arn,
            "Condition": {"StringEquals": {"elasticfilesystem:AccessPointArn": access_point_arn},
                          "Bool": {"elasticfilesystem:AccessedViaMountTarget": "true"}}})
    return json.dumps({"Version": "2012-10-17", "Statement": statements})
