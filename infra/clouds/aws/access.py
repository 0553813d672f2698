"""AWS access: one role (and instance profile) per VM node group, limited to that group's grants
in the bucket (infra/resolve/access.py), Session Manager instead of SSH keys, and pulls from the stack's
ECR repository only; the EKS cluster role, and an EKS node role that reads only the node bundle
(pods get their group's grants through EKS Pod Identity, infra/clouds/aws/kubernetes.py). No
key pairs or passwords are created.

No AWS-managed policy beyond what EKS itself requires: AmazonSSMManagedInstanceCore would let
every node read every SSM parameter of the account (ssm:GetParameter(s) on "*") and
AmazonEC2ContainerRegistryReadOnly every repository (team vision's nodes could pull prod's
image). In their place (AWS Systems Manager user guide, "Create a custom IAM instance profile
for Session Manager", getting-started-create-iam-instance-profile; Amazon ECR user guide,
"Private repository policy examples" and the Service Authorization Reference for ECR):
- Session Manager (docs/tenancy.md: the way onto a node): ssmmessages:{Create,Open}{Control,Data}Channel,
  which take no resource ("*" is the only value the reference allows), and
  ssm:UpdateInstanceInformation on this account's instances.
- ECR: ecr:GetAuthorizationToken, which takes no resource either ("*"; the token is for the
  registry, each pull is authorized per repository), then BatchGetImage, GetDownloadUrlForLayer
  and BatchCheckLayerAvailability on the stack's repository (allow_pull) — and, for EKS nodes,
  on the repositories of EKS's own add-on images (ADDON_REPOSITORIES)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.core.names import fit
from infra.resolve.access import CLUSTER_NODE, Grants

MANAGED = "arn:aws:iam::aws:policy/"
# What EKS requires of a node role (EKS user guide, create-node-role): the kubelet's and the VPC
# CNI's permissions. Pulls and Session Manager are the stack's own statements below.
EKS_NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy")
SESSION_CHANNELS = ["ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
                    "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"]
PULL_ACTIONS = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
# The repositories EKS's add-on images come from (EKS user guide, add-ons-images: the VPC CNI,
# kube-proxy, CoreDNS, the Pod Identity agent, the EFS CSI driver and its sidecars live in
# AWS-owned accounts under these names); the stack's own repositories are named
# gpu-training-stack/<env>/trainer, so no team's repository matches.
ADDON_REPOSITORIES = ("eks/*", "amazon-k8s-cni", "amazon-k8s-cni-init", "amazon/aws-network-policy-agent")


def node_policy(partition: str, account: str, repository_arns: list[str], addon_images: bool) -> str:
    """Session Manager on this account's instances, and pulls from the given repositories only."""
    pulls = list(repository_arns)
    if addon_images:
        pulls += [f"arn:{partition}:ecr:*:*:repository/{r}" for r in ADDON_REPOSITORIES]
    statements: list[dict[str, object]] = [
        {"Sid": "SessionManagerChannels", "Effect": "Allow", "Action": SESSION_CHANNELS, "Resource": "*"},
        {"Sid": "SessionManagerRegistration", "Effect": "Allow", "Action": "ssm:UpdateInstanceInformation",
         "Resource": f"arn:{partition}:ec2:*:{account}:instance/*"},
        {"Sid": "RegistryToken", "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"}]
    if pulls:
        statements.append({"Sid": "PullOwnImages", "Effect": "Allow", "Action": PULL_ACTIONS, "Resource": pulls})
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def assume(service: str, tag_session: bool = False) -> str:
    actions: str | list[str] = ["sts:AssumeRole", "sts:TagSession"] if tag_session else "sts:AssumeRole"
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": service}, "Action": actions}]})


def bucket_policy(bucket_arn: str, key_arn: str, grants: Grants) -> str:
    """List, read and write only under the grants' prefixes of the stack's bucket."""
    statements: list[dict[str, object]] = [
        {"Sid": "List", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": bucket_arn,
         "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in grants.prefixes]}}},
        {"Sid": "Read", "Effect": "Allow", "Action": "s3:GetObject",
         "Resource": [f"{bucket_arn}/{p}*" for p in grants.prefixes]},
        {"Sid": "BucketKey", "Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"], "Resource": key_arn}]
    if grants.writes:
        statements.insert(2, {"Sid": "Write", "Effect": "Allow",
                              "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                              "Resource": [f"{bucket_arn}/{p}*" for p in grants.writes]})
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


@dataclass
class AwsAccessArgs:
    bucket_arn: pulumi.Output[str]
    key_arn: pulumi.Output[str]
    env: str
    tags: dict[str, str]
    groups: dict[str, Grants] = field(default_factory=dict)  # VM node groups
    kubernetes: bool = False


class AwsAccess(pulumi.ComponentResource):
    profiles: dict[str, aws.iam.InstanceProfile]
    eks_cluster_role: aws.iam.Role | None
    eks_node_role: aws.iam.Role | None

    def __init__(self, name: str, args: AwsAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Access", name, None, opts)
        self.child = pulumi.ResourceOptions(parent=self)
        self.args = args
        self.profiles = {}
        self.roles: dict[str, aws.iam.Role] = {}  # node roles by resource name
        for group, grants in args.groups.items():
            role = self._role(f"{name}-{group}", f"{args.env}-{group}-node", "ec2.amazonaws.com", grants,
                              f"GPU nodes of {group}: its dataset, its own checkpoints", ())
            self.roles[f"{name}-{group}"] = role
            self.profiles[group] = aws.iam.InstanceProfile(f"{name}-{group}", role=role.name, tags=args.tags,
                                                           opts=self.child)

        self.eks_cluster_role = self.eks_node_role = None
        if args.kubernetes:
            self.eks_cluster_role = aws.iam.Role(f"{name}-eks-cluster", assume_role_policy=assume("eks.amazonaws.com"),
                                                 tags=args.tags, opts=self.child)
            aws.iam.RolePolicyAttachment(f"{name}-eks-cluster-policy", role=self.eks_cluster_role.name,
                                         policy_arn=MANAGED + "AmazonEKSClusterPolicy", opts=self.child)
            self.eks_node_role = self._role(f"{name}-eks-node", f"{args.env}-eks-node", "ec2.amazonaws.com",
                                            CLUSTER_NODE, "EKS nodes: the node bundle only",
                                            tuple(MANAGED + p for p in EKS_NODE_POLICIES))
            self.roles[f"{name}-eks-node"] = self.eks_node_role
        self.register_outputs({"groups": sorted(self.profiles)})

    def node_roles(self) -> dict[str, aws.iam.Role]:
        """Every role a node (VM, store or EKS node) runs with, by resource name."""
        return dict(self.roles)

    def allow_pull(self, name: str, repository_arns: pulumi.Input[list[str]]) -> None:
        """Session Manager and pulls from these repositories (the stack's own) for every node role;
        EKS nodes also from EKS's add-on repositories."""
        identity = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self))
        partition = aws.get_partition_output(opts=pulumi.InvokeOutputOptions(parent=self))
        def document(values: list[Any], addons: bool) -> str:
            return node_policy(str(values[0]), str(values[1]), [str(a) for a in values[2]], addons)

        for res_name, role in self.roles.items():
            addons = role is self.eks_node_role
            policy = pulumi.Output.all(partition.partition, identity.account_id, repository_arns).apply(
                functools.partial(document, addons=addons))
            aws.iam.RolePolicy(f"{res_name}-{name}", role=role.id, policy=policy, opts=self.child)

    def pod_role(self, name: str, role_name: str, grants: Grants) -> aws.iam.Role:
        """A role for EKS Pod Identity (pods.eks.amazonaws.com, AssumeRole + TagSession)."""
        return self._role(name, role_name, "pods.eks.amazonaws.com", grants, f"pods: {role_name}", (), tag_session=True)

    def _role(self, name: str, role_name: str, service: str, grants: Grants, description: str,
              managed: tuple[str, ...], tag_session: bool = False) -> aws.iam.Role:
        args = self.args
        role = aws.iam.Role(name, name=fit(role_name, "iamRole"), assume_role_policy=assume(service, tag_session),
                            description=description, tags=args.tags, opts=self.child)
        policy = pulumi.Output.all(args.bucket_arn, args.key_arn).apply(lambda ak: bucket_policy(ak[0], ak[1], grants))
        aws.iam.RolePolicy(f"{name}-bucket", role=role.id, policy=policy, opts=self.child)
        for arn in managed:
            aws.iam.RolePolicyAttachment(f"{name}-{arn.rsplit('/', 1)[-1]}", role=role.name, policy_arn=arn,
                                         opts=self.child)
        return role
