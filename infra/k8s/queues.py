"""Kueue on a shared cluster: the teams' GPU quotas as queues (infra/teams/queues.py has the
numbers).

Sources (kubernetes-sigs/kueue v0.19.2): the chart is published at
oci://registry.k8s.io/kueue/charts/kueue, version without the `v` (hack/helm-chart-package.sh);
ClusterQueue / LocalQueue / ResourceFlavor are served and stored as kueue.x-k8s.io/v1beta2
(v1beta1 deprecated), the cohort is `spec.cohortName`; a ClusterQueue without namespaceSelector
admits no namespace; each flavor lists exactly the covered resources in their order and a
resource the queue does not cover blocks admission (flavorassigner.go), so cpu, memory and GPUs
are all covered; a flavor's nodeLabels and tolerations are injected into the admitted pods
(pkg/podset/podset.go). A Job is one Workload whose pods are admitted together, and
waitForPodsReady evicts and requeues a Job whose pods do not all start in time, so a multi-node
run never holds half its GPUs idle; the manager's config is one YAML string that replaces the
chart's default, so the whole of it is here.

Quota cannot be skipped (issue 41): `manageJobsWithoutQueueName` has Kueue manage (suspend until
admitted) every Job of a labelled namespace, with or without the queue label (Kueue
configuration_types.go: unlabelled Jobs are otherwise "not managed" and start at once); a
ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, GA in Kubernetes 1.30; EKS 1.35,
TKE 1.30, ACK the newest) refuses such a Job at creation with one line; and each team's namespace
carries a ResourceQuota on `requests.nvidia.com/gpu` (extended resources take the `requests.`
prefix only, Kubernetes "Resource Quotas") at what its queue may ever be admitted — its nominal
GPUs, or the cohort's when it may borrow — so not even a Job that Kueue never saw runs past it.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from infra.k8s import netpol
from infra.model.images import pulled
from infra.model.spec import Mirrors
from infra.pods import LABEL_CLOUD, LABEL_TEAM, NAMESPACE as TRAINING_NAMESPACE, QUEUES_MANAGED, QUEUE_LABEL
from infra.resolve.groups import LABEL_CAPACITY, LABEL_GPU_MODEL, LABEL_POOL
from infra.teams.queues import GPU, Flavor, Queue

CHART = "oci://registry.k8s.io/kueue/charts/kueue"
CHART_VERSION = "0.19.2"
IMAGE = f"registry.k8s.io/kueue/kueue:v{CHART_VERSION}"
API = "kueue.x-k8s.io/v1beta2"
NAMESPACE = "kueue-system"
MANAGED = QUEUES_MANAGED  # on the namespaces whose Jobs Kueue manages (and only those)
TEAM_GROUP = "gts:team:{team}"  # the Kubernetes group a team's people are mapped to (docs/teams.md)
PODS_READY_TIMEOUT = "15m"  # image pull + dataset cache of a big node; then evicted and requeued


def manager_config() -> str:
    """Kueue's Configuration: the chart's default (values.yaml) with only batch/job managed, only in
    the labelled namespaces (the chart reuses this selector for its webhooks, which fail closed),
    all-or-nothing start with admission blocked meanwhile, and per-queue usage metrics."""
    return yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"},
        "metrics": {"bindAddress": ":8443", "enableClusterQueueResources": True},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        "controller": {"groupKindConcurrency": {"Job.batch": 5, "Workload.kueue.x-k8s.io": 10,
                                                "LocalQueue.kueue.x-k8s.io": 5, "ClusterQueue.kueue.x-k8s.io": 5,
                                                "ResourceFlavor.kueue.x-k8s.io": 1}},
        "clientConnection": {"qps": 300, "burst": 500},
        "waitForPodsReady": {"timeout": PODS_READY_TIMEOUT, "blockAdmission": True,
                             "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60,
                                                   "backoffMaxSeconds": 3600}},
        "managedJobsNamespaceSelector": {"matchLabels": {MANAGED: "true"}},
        "manageJobsWithoutQueueName": True,  # confined to the namespaces above
        "integrations": {"frameworks": ["batch/job"]},
    }, sort_keys=False)


def chart_values(mirrors: Mirrors) -> dict[str, Any]:
    repository, _, tag = pulled(IMAGE, mirrors).rpartition(":")
    on_system_pool = {LABEL_POOL: "system"}
    return {
        "fullnameOverride": "kueue",
        "controllerManager": {
            "replicas": 2, "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
            "nodeSelector": on_system_pool,
            "manager": {"image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"}},
        },
        "managerConfig": {"controllerManagerConfigYaml": manager_config()},
    }


QUEUE_POLICY = "gts-jobs-need-a-queue"
QUEUE_RULE = (f"has(object.metadata.labels) && '{QUEUE_LABEL}' in object.metadata.labels"
              f" && object.metadata.labels['{QUEUE_LABEL}'] != ''")


def queue_policy(name: str, opts: pulumi.ResourceOptions) -> None:
    """Jobs in a Kueue-managed namespace must name their LocalQueue (refused at creation otherwise)."""
    policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
        f"{name}-queue-policy", metadata=k8s.meta.v1.ObjectMetaArgs(name=QUEUE_POLICY),
        spec=k8s.admissionregistration.v1.ValidatingAdmissionPolicySpecArgs(
            failure_policy="Fail",
            match_constraints=k8s.admissionregistration.v1.MatchResourcesArgs(
                namespace_selector=k8s.meta.v1.LabelSelectorArgs(match_labels={MANAGED: "true"}),
                resource_rules=[k8s.admissionregistration.v1.NamedRuleWithOperationsArgs(
                    api_groups=["batch"], api_versions=["v1"], operations=["CREATE", "UPDATE"], resources=["jobs"])]),
            validations=[k8s.admissionregistration.v1.ValidationArgs(
                expression=QUEUE_RULE, reason="Forbidden",
                message=f"a Job here must carry the label {QUEUE_LABEL}: <its team's LocalQueue> (docs/teams.md)")]),
        opts=opts)
    k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
        f"{name}-queue-policy", metadata=k8s.meta.v1.ObjectMetaArgs(name=QUEUE_POLICY),
        spec=k8s.admissionregistration.v1.ValidatingAdmissionPolicyBindingSpecArgs(
            policy_name=QUEUE_POLICY, validation_actions=["Deny"]),
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[policy])))


def gpu_cap(queue: Queue, queues: list[Queue]) -> int:
    """The most GPUs a queue can ever be admitted: its nominal quota, or the cohort's with borrowing."""
    return sum(sum(q.gpus.values()) for q in (queues if queue.borrowing else [queue]))


def _flavor_spec(flavor: Flavor) -> dict[str, Any]:
    taint = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
    return {"nodeLabels": {LABEL_GPU_MODEL: flavor.model, LABEL_CAPACITY: flavor.market},
            "nodeTaints": [taint], "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                    "effect": "NoSchedule"}]}


def _queue_spec(queue: Queue, flavors: dict[str, Flavor], cohort: str) -> dict[str, Any]:
    entries = []
    for name in sorted(queue.gpus, key=lambda n: (flavors[n].market != "spot", n)):  # spot first: cheaper
        quota = queue.resources(flavors[name])
        no_borrow = {} if queue.borrowing else {"borrowingLimit": "0"}
        entries.append({"name": name, "resources": [
            {"name": "cpu", "nominalQuota": str(quota["cpu"]), **no_borrow},
            {"name": "memory", "nominalQuota": f"{quota['memory']}Gi", **no_borrow},
            {"name": GPU, "nominalQuota": str(quota[GPU]), **no_borrow}]})
    return {"cohortName": cohort, "queueingStrategy": "BestEffortFIFO",
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": queue.namespace}},
            "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "Never"},
            "resourceGroups": [{"coveredResources": ["cpu", "memory", GPU], "flavors": entries}]}


class SharedQueues(pulumi.ComponentResource):
    """Kueue, the flavors, a ClusterQueue per queue in one cohort, and per team a namespace
    (restricted, managed by Kueue), its LocalQueue and a Role its people get through a group."""

    def __init__(self, name: str, cloud: str, flavors: dict[str, Flavor], queues: list[Queue], mirrors: Mirrors,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:k8s:SharedQueues", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.release = k8s.helm.v3.Release(
            f"{name}-kueue", name="kueue", chart=CHART, version=CHART_VERSION, namespace=NAMESPACE,
            create_namespace=True, values=chart_values(mirrors), opts=child)
        after = pulumi.ResourceOptions(parent=self, depends_on=[self.release])
        made = [k8s.apiextensions.CustomResource(
            f"{name}-flavor-{f.name}", api_version=API, kind="ResourceFlavor",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=f.name), spec=_flavor_spec(f), opts=after)
            for f in flavors.values()]
        after_flavors = pulumi.ResourceOptions(parent=self, depends_on=[self.release, *made])
        queue_policy(name, child)
        self.local_queues: list[pulumi.Resource] = []
        for queue in queues:
            cluster_queue = k8s.apiextensions.CustomResource(
                f"{name}-cq-{queue.name}", api_version=API, kind="ClusterQueue",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=queue.name, labels={LABEL_TEAM: queue.team, LABEL_CLOUD: cloud}),
                spec=_queue_spec(queue, flavors, cohort=name), opts=after_flavors)
            namespace: pulumi.Input[str] = queue.namespace
            if queue.namespace != TRAINING_NAMESPACE:  # the stack's own namespace exists already (infra/k8s/job.py)
                namespace = self._team_namespace(name, cloud, queue, gpu_cap(queue, queues), child).metadata.name
            self.local_queues.append(k8s.apiextensions.CustomResource(
                f"{name}-lq-{queue.name}", api_version=API, kind="LocalQueue",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=queue.local_queue, namespace=namespace,
                                                    labels={LABEL_TEAM: queue.team}),
                spec={"clusterQueue": queue.name},
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.release, cluster_queue])))
        self.register_outputs({"queues": [q.name for q in queues]})

    @staticmethod
    def _team_namespace(name: str, cloud: str, queue: Queue, gpus: int,
                        child: pulumi.ResourceOptions) -> k8s.core.v1.Namespace:
        labels = {MANAGED: "true", LABEL_TEAM: queue.team,
                  **{f"pod-security.kubernetes.io/{m}": "restricted" for m in ("enforce", "audit", "warn")}}
        ns = k8s.core.v1.Namespace(f"{name}-ns-{queue.team}", metadata=k8s.meta.v1.ObjectMetaArgs(
            name=queue.namespace, labels=labels), opts=child)
        ns_opts = pulumi.ResourceOptions(parent=ns)
        k8s.core.v1.ResourceQuota(f"{name}-quota-{queue.team}", metadata=k8s.meta.v1.ObjectMetaArgs(
            name="gpu-quota", namespace=ns.metadata.name, labels={LABEL_TEAM: queue.team}),
            spec=k8s.core.v1.ResourceQuotaSpecArgs(hard={f"requests.{GPU}": str(gpus)}), opts=ns_opts)
        # A team's pods: each other, DNS and out, never the metadata service (its node's role is
        # the GPU pool's, not the team's) nor another namespace (docs/tenancy.md).
        netpol.namespace_baseline(f"{name}-{queue.team}", ns.metadata.name, {LABEL_TEAM: queue.team}, ns_opts,
                                  same_namespace=True, extra_egress=netpol.pod_identity_egress(cloud))
        role = k8s.rbac.v1.Role(f"{name}-role-{queue.team}", metadata=k8s.meta.v1.ObjectMetaArgs(
            name="team-member", namespace=ns.metadata.name, labels={LABEL_TEAM: queue.team}),
            rules=[k8s.rbac.v1.PolicyRuleArgs(api_groups=["batch"], resources=["jobs"],
                                              verbs=["create", "delete", "get", "list", "watch", "patch"]),
                   k8s.rbac.v1.PolicyRuleArgs(api_groups=[""], resources=["pods", "pods/log", "events"],
                                              verbs=["get", "list", "watch"]),
                   k8s.rbac.v1.PolicyRuleArgs(api_groups=["kueue.x-k8s.io"], resources=["localqueues", "workloads"],
                                              verbs=["get", "list", "watch"])],
            opts=ns_opts)
        k8s.rbac.v1.RoleBinding(f"{name}-binding-{queue.team}", metadata=k8s.meta.v1.ObjectMetaArgs(
            name="team-member", namespace=ns.metadata.name, labels={LABEL_TEAM: queue.team}),
            role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="Role",
                                             name=role.metadata.name),
            subjects=[k8s.rbac.v1.SubjectArgs(kind="Group", name=TEAM_GROUP.format(team=queue.team),
                                              api_group="rbac.authorization.k8s.io")],
            opts=ns_opts)
        return ns
