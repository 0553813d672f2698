"""AWS access: node roles limited to the stack's bucket prefix, Session Manager instead of SSH
keys, and the EKS cluster and node roles. No key pairs or passwords are created."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

MANAGED = "arn:aws:iam::aws:policy/"
SSM_CORE = MANAGED + "AmazonSSMManagedInstanceCore"
EKS_NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy",
                     "AmazonEC2ContainerRegistryReadOnly", "AmazonSSMManagedInstanceCore")


def _assume(service: str) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]})


def bucket_policy(bucket_arn: str, key_arn: str, prefixes: list[str]) -> str:
    """Read datasets, read/write checkpoints: only under the stack's prefixes of its bucket."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "ListOwnPrefixes", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": bucket_arn,
         "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in prefixes]}}},
        {"Sid": "ObjectsUnderOwnPrefixes", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
         "Resource": [f"{bucket_arn}/{p}*" for p in prefixes]},
        {"Sid": "BucketKey", "Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
         "Resource": key_arn},
    ]})


@dataclass
class AwsAccessArgs:
    bucket_arn: pulumi.Output[str]
    key_arn: pulumi.Output[str]
    prefixes: list[str]
    tags: dict[str, str]
    kubernetes: bool


class AwsAccess(pulumi.ComponentResource):
    node_role: aws.iam.Role
    instance_profile: aws.iam.InstanceProfile
    eks_cluster_role: aws.iam.Role | None
    eks_node_role: aws.iam.Role | None

    def __init__(self, name: str, args: AwsAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Access", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        policy = pulumi.Output.all(args.bucket_arn, args.key_arn).apply(
            lambda ak: bucket_policy(ak[0], ak[1], args.prefixes))

        self.node_role = aws.iam.Role(f"{name}-node", assume_role_policy=_assume("ec2.amazonaws.com"),
                                      description="GPU training nodes: own bucket prefixes and Session Manager",
                                      tags=args.tags, opts=child)
        aws.iam.RolePolicy(f"{name}-node-bucket", role=self.node_role.id, policy=policy, opts=child)
        aws.iam.RolePolicyAttachment(f"{name}-node-ssm", role=self.node_role.name, policy_arn=SSM_CORE, opts=child)
        self.instance_profile = aws.iam.InstanceProfile(f"{name}-node", role=self.node_role.name, tags=args.tags,
                                                        opts=child)

        self.eks_cluster_role = self.eks_node_role = None
        if args.kubernetes:
            self.eks_cluster_role = aws.iam.Role(f"{name}-eks-cluster", assume_role_policy=_assume("eks.amazonaws.com"),
                                                 tags=args.tags, opts=child)
            aws.iam.RolePolicyAttachment(f"{name}-eks-cluster-policy", role=self.eks_cluster_role.name,
                                         policy_arn=MANAGED + "AmazonEKSClusterPolicy", opts=child)
            self.eks_node_role = aws.iam.Role(f"{name}-eks-node", assume_role_policy=_assume("ec2.amazonaws.com"),
                                              tags=args.tags, opts=child)
            for managed in EKS_NODE_POLICIES:
                aws.iam.RolePolicyAttachment(f"{name}-eks-node-{managed}", role=self.eks_node_role.name,
                                             policy_arn=MANAGED + managed, opts=child)
            aws.iam.RolePolicy(f"{name}-eks-node-bucket", role=self.eks_node_role.id, policy=policy, opts=child)
        self.register_outputs({"nodeRoleArn": self.node_role.arn})
