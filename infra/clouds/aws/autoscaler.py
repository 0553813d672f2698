"""Cluster Autoscaler on EKS: grows the GPU node groups from zero when training pods wait and
shrinks them when idle. Its AWS permissions come through EKS Pod Identity (the nodes' IMDS hop
limit is 1, so no pod can borrow the node role). Manifest after kubernetes/autoscaler
cluster-autoscaler/cloudprovider/aws/examples/cluster-autoscaler-autodiscover.yaml; IAM policy
from that provider's README, scoped as its "Minimal IAM Permissions Policy" asks: the write
actions only on Auto Scaling groups tagged k8s.io/cluster-autoscaler/enabled=true and
k8s.io/cluster-autoscaler/<cluster>=owned (EKS puts both tags on a managed node group's group:
EKS user guide, managed-node-groups), and here also only on this cluster's GPU node groups' own
Auto Scaling groups by ARN, so an autoscaler (or whoever takes its pod) cannot resize or
terminate another stack's or team's groups. Describe* calls take no resource ("*", Service
Authorization Reference for EC2 Auto Scaling and EC2); eks:DescribeNodegroup is limited to the
cluster's node groups."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.core.names import fit

NAMESPACE = "kube-system"
ACCOUNT = "cluster-autoscaler"
READ_ACTIONS = ["autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeAutoScalingInstances",
                "autoscaling:DescribeLaunchConfigurations", "autoscaling:DescribeScalingActivities",
                "autoscaling:DescribeTags", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplateVersions", "ec2:GetInstanceTypesFromInstanceRequirements"]
WRITE_ACTIONS = ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"]
# (api groups, resources, verbs[, resource names]) of the example's ClusterRole
CLUSTER_RULES: list[tuple[list[str], list[str], list[str], list[str]]] = [
    ([""], ["events", "endpoints"], ["create", "patch"], []),
    ([""], ["pods/eviction"], ["create"], []),
    ([""], ["pods/status"], ["update"], []),
    ([""], ["endpoints"], ["get", "update"], ["cluster-autoscaler"]),
    ([""], ["nodes"], ["watch", "list", "get", "update"], []),
    ([""], ["namespaces", "pods", "services", "replicationcontrollers", "persistentvolumeclaims",
            "persistentvolumes"], ["watch", "list", "get"], []),
    (["extensions"], ["replicasets", "daemonsets"], ["watch", "list", "get"], []),
    (["policy"], ["poddisruptionbudgets"], ["watch", "list"], []),
    (["apps"], ["statefulsets", "replicasets", "daemonsets"], ["watch", "list", "get"], []),
    (["storage.k8s.io"], ["storageclasses", "csinodes", "csidrivers", "csistoragecapacities", "volumeattachments"],
     ["watch", "list", "get"], []),
    (["batch", "extensions"], ["jobs"], ["get", "list", "watch", "patch"], []),
    (["coordination.k8s.io"], ["leases"], ["create"], []),
    (["coordination.k8s.io"], ["leases"], ["get", "update"], ["cluster-autoscaler"]),
]
ROLE_RULES: list[tuple[list[str], list[str], list[str], list[str]]] = [
    ([""], ["configmaps"], ["create", "list", "watch"], []),
    ([""], ["configmaps"], ["delete", "get", "update", "watch"],
     ["cluster-autoscaler-status", "cluster-autoscaler-priority-expander"]),
]


def _rules(rules: list[tuple[list[str], list[str], list[str], list[str]]]) -> list[k8s.rbac.v1.PolicyRuleArgs]:
    return [k8s.rbac.v1.PolicyRuleArgs(api_groups=g, resources=r, verbs=v, resource_names=n or None)
            for g, r, v, n in rules]


def policy_document(partition: str, region: str, account: str, cluster: str, asg_names: list[str]) -> str:
    """Read anything the autoscaler discovers; write only to this cluster's tagged GPU groups."""
    groups = [f"arn:{partition}:autoscaling:{region}:{account}:autoScalingGroup:*:autoScalingGroupName/{n}"
              for n in asg_names]
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "Discover", "Effect": "Allow", "Action": READ_ACTIONS, "Resource": "*"},
        {"Sid": "DescribeOwnNodegroups", "Effect": "Allow", "Action": "eks:DescribeNodegroup",
         "Resource": f"arn:{partition}:eks:{region}:{account}:nodegroup/{cluster}/*/*"},
        {"Sid": "ScaleOwnGroups", "Effect": "Allow", "Action": WRITE_ACTIONS, "Resource": groups,
         "Condition": {"StringEquals": {"aws:ResourceTag/k8s.io/cluster-autoscaler/enabled": "true",
                                        f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cluster}": "owned"}}}]})


def pod_identity_trust() -> str:
    """EKS Pod Identity: the service principal pods.eks.amazonaws.com, AssumeRole and TagSession
    (EKS user guide, pod-id-role)."""
    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": "pods.eks.amazonaws.com"},
        "Action": ["sts:AssumeRole", "sts:TagSession"]}]})


@dataclass
class EksAutoscalerArgs:
    cluster_name: pulumi.Output[str]
    asg_names: list[pulumi.Output[str]]  # the Auto Scaling groups of the cluster's GPU node groups
    region: str
    image: str
    system_selector: dict[str, str]  # the untainted system pool it runs on
    pod_identity_agent: pulumi.Resource
    aws_provider: pulumi.ProviderResource
    k8s_provider: pulumi.ProviderResource
    tags: dict[str, str]


class EksClusterAutoscaler(pulumi.ComponentResource):
    def __init__(self, name: str, args: EksAutoscalerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:ClusterAutoscaler", name, None, opts)
        on_aws = pulumi.ResourceOptions(parent=self, provider=args.aws_provider)
        on_k8s = pulumi.ResourceOptions(parent=self, provider=args.k8s_provider)
        role = aws.iam.Role(f"{name}-role", name=fit(f"{name}-autoscaler", "iamRole"),
                            assume_role_policy=pod_identity_trust(), tags=args.tags, opts=on_aws)
        invoke = pulumi.InvokeOutputOptions(parent=self, provider=args.aws_provider)
        account_id = aws.get_caller_identity_output(opts=invoke).account_id
        partition = aws.get_partition_output(opts=invoke).partition
        policy = pulumi.Output.all(partition, account_id, args.cluster_name, *args.asg_names).apply(
            lambda v: policy_document(str(v[0]), args.region, str(v[1]), str(v[2]), [str(n) for n in v[3:]]))
        aws.iam.RolePolicy(f"{name}-policy", role=role.id, policy=policy, opts=on_aws)
        aws.eks.PodIdentityAssociation(
            f"{name}-identity", cluster_name=args.cluster_name, namespace=NAMESPACE, service_account=ACCOUNT,
            role_arn=role.arn, tags=args.tags,
            opts=pulumi.ResourceOptions.merge(on_aws, pulumi.ResourceOptions(depends_on=[args.pod_identity_agent])))

        labels = {"app.kubernetes.io/name": ACCOUNT}
        meta = k8s.meta.v1.ObjectMetaArgs(name=ACCOUNT, namespace=NAMESPACE, labels=labels)
        account = k8s.core.v1.ServiceAccount(f"{name}-sa", metadata=meta, opts=on_k8s)
        cluster_role = k8s.rbac.v1.ClusterRole(f"{name}-cr", metadata=k8s.meta.v1.ObjectMetaArgs(name=ACCOUNT, labels=labels),
                                               rules=_rules(CLUSTER_RULES), opts=on_k8s)
        k8s.rbac.v1.ClusterRoleBinding(
            f"{name}-crb", metadata=k8s.meta.v1.ObjectMetaArgs(name=ACCOUNT, labels=labels),
            role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="ClusterRole",
                                             name=cluster_role.metadata.name),
            subjects=[k8s.rbac.v1.SubjectArgs(kind="ServiceAccount", name=ACCOUNT, namespace=NAMESPACE)], opts=on_k8s)
        ns_role = k8s.rbac.v1.Role(f"{name}-role-k8s", metadata=meta, rules=_rules(ROLE_RULES), opts=on_k8s)
        k8s.rbac.v1.RoleBinding(
            f"{name}-rb", metadata=meta,
            role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="Role", name=ns_role.metadata.name),
            subjects=[k8s.rbac.v1.SubjectArgs(kind="ServiceAccount", name=ACCOUNT, namespace=NAMESPACE)], opts=on_k8s)
        discovery = args.cluster_name.apply(
            lambda c: f"--node-group-auto-discovery=asg:tag=k8s.io/cluster-autoscaler/enabled,k8s.io/cluster-autoscaler/{c}")
        k8s.apps.v1.Deployment(
            f"{name}-deploy", metadata=meta,
            spec=k8s.apps.v1.DeploymentSpecArgs(
                replicas=1, selector=k8s.meta.v1.LabelSelectorArgs(match_labels=labels),
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels),
                    spec=k8s.core.v1.PodSpecArgs(
                        service_account_name=account.metadata.name, priority_class_name="system-cluster-critical",
                        node_selector=args.system_selector,
                        security_context=k8s.core.v1.PodSecurityContextArgs(
                            run_as_non_root=True, run_as_user=65534, fs_group=65534,
                            seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault")),
                        containers=[k8s.core.v1.ContainerArgs(
                            name="cluster-autoscaler", image=args.image,
                            command=["./cluster-autoscaler", "--v=4", "--stderrthreshold=info", "--cloud-provider=aws",
                                     "--skip-nodes-with-local-storage=false", "--expander=least-waste",
                                     "--balance-similar-node-groups", discovery],
                            # The node's IMDS is out of reach (hop limit 1): the region comes from here.
                            env=[k8s.core.v1.EnvVarArgs(name="AWS_REGION", value=args.region)],
                            resources=k8s.core.v1.ResourceRequirementsArgs(
                                requests={"cpu": "100m", "memory": "600Mi"}, limits={"cpu": "100m", "memory": "600Mi"}),
                            security_context=k8s.core.v1.SecurityContextArgs(
                                allow_privilege_escalation=False, read_only_root_filesystem=True,
                                capabilities=k8s.core.v1.CapabilitiesArgs(drop=["ALL"])))]))),
            opts=on_k8s)
        self.register_outputs({"roleArn": role.arn})
