"""AWS access: one role (and instance profile) per VM node group, limited to that group's grants
in the bucket (infra/access.py), Session Manager instead of SSH keys, and pulls from the stack's
ECR repository; the EKS cluster role, and an EKS node role that reads only the node bundle (pods
get their group's grants through EKS Pod Identity, infra/clouds/aws/kubernetes.py). No key pairs
or passwords are created."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.access import CLUSTER_NODE, Grants
from infra.names import fit

MANAGED = "arn:aws:iam::aws:policy/"
SSM_CORE = MANAGED + "AmazonSSMManagedInstanceCore"
ECR_READ = MANAGED + "AmazonEC2ContainerRegistryReadOnly"
EKS_NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy",
                     "AmazonEC2ContainerRegistryReadOnly", "AmazonSSMManagedInstanceCore")


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
        for group, grants in args.groups.items():
            role = self._role(f"{name}-{group}", f"{args.env}-{group}-node", "ec2.amazonaws.com", grants,
                              f"GPU nodes of {group}: its dataset, its own checkpoints", (SSM_CORE, ECR_READ))
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
        self.register_outputs({"groups": sorted(self.profiles)})

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
