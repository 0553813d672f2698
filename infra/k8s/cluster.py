"""What the stack puts on every managed cluster once its node pools exist."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random as random

from infra import clouds
from infra.k8s import netpol
from infra.k8s.daemons import FabricDevicePlugin, GpuNodeExporters, NvidiaDevicePlugin
from infra.k8s.job import Identity, deploy_training_jobs, training_namespace
from infra.k8s.queues import SharedQueues
from infra.model.images import node_agents, pulled
from infra.model.spec import StackSpec
from infra.pods import LABEL_TEAM
from infra.resolve.groups import ResolvedGroup, Stack
from infra.resolve.sharedfs import SharedFsOutputs
from infra.teams import queues
from infra.teams.registry import Registry


def cluster_workloads(name: str, kubeconfig: pulumi.Input[str], pools: Sequence[pulumi.Resource], spec: StackSpec,
                      groups: list[ResolvedGroup], parent: pulumi.Resource, device_plugin: bool,
                      trainer_images: Mapping[str, pulumi.Output[str]], identities: dict[str, Identity],
                      shared: SharedFsOutputs | None = None, teams: Registry | None = None) -> k8s.Provider:
    """A Kubernetes provider on the new cluster (after its node pools exist, so the system pods
    have somewhere to run), the NVIDIA device plugin where the cloud does not install it, the GPU
    node exporters, the restricted training namespace and the training Jobs."""
    provider = k8s.Provider(f"{name}-k8s", kubeconfig=kubeconfig,
                            opts=pulumi.ResourceOptions(parent=parent, depends_on=list(pools)))
    opts = pulumi.ResourceOptions(parent=parent, provider=provider)
    images = node_agents(spec.clouds[groups[0].group.cloud].mirrors)
    if device_plugin:
        NvidiaDevicePlugin(f"{name}-nvidia", images.device_plugin, opts=opts)
    own = clouds.profile(groups[0].cloud)
    fabric_groups = [g.name for g in groups if g.fabric is not None]
    if fabric_groups and own.fabric_device_plugin:  # where the cloud's own add-on does not advertise it
        FabricDevicePlugin(f"{name}-{own.fabric}", pulled(own.fabric_device_plugin,
                                                          spec.clouds[groups[0].group.cloud].mirrors),
                           fabric_groups, opts=opts)
    GpuNodeExporters(f"{name}-exporters", images, opts=opts)
    queued = shared_queues(name, spec, groups, opts, teams)
    namespace = training_namespace(name, opts, managed=queued is not None).metadata.name
    labels = {"env": spec.env, LABEL_TEAM: spec.team_name}
    cloud = groups[0].cloud
    # The training namespace: default deny, DNS, out but not to the metadata service on any cloud:
    # the stack's own Jobs hold their own roles (EKS Pod Identity, ACK RRSA, TKE pod identity),
    # never the node's; other teams' namespaces never reach it either (infra/k8s/queues.py).
    netpol.namespace_baseline(f"{name}-training", namespace, labels, opts,
                              extra_egress=netpol.pod_identity_egress(cloud))
    queue, after = queued if queued else (None, [])
    # Multi-node Jobs' rendezvous keys (training/node/rdzv_launch.py) come from the random provider,
    # explicit like every provider here (the stacks disable default providers).
    keys = None
    if any(g.workload == "training" and g.max_nodes > 1 for g in groups):
        keys = random.Provider(f"{name}-random", opts=pulumi.ResourceOptions(parent=parent))
    deploy_training_jobs(groups, trainer_images, identities, namespace, labels, opts, shared, queue, after, keys)
    return provider


def shared_queues(name: str, spec: StackSpec, groups: list[ResolvedGroup], opts: pulumi.ResourceOptions,
                  teams: Registry | None) -> tuple[str, list[pulumi.Resource]] | None:
    """Kueue and the teams' queues where the stack shares its clusters (kubernetes.queues): the
    LocalQueue its own Jobs are submitted to and what they wait for; None elsewhere. `teams`: the
    registry the edge read and validation checked (the Stack's), never read again here."""
    if not spec.kubernetes.queues:
        return None
    if teams is None:
        raise ValueError(f"kubernetes.queues names {spec.kubernetes.queues} but no checked team registry was "
                         "handed to the cluster (the Stack's teams, read at the edge)")
    stack = Stack(spec, tuple(groups), teams)
    cloud = groups[0].cloud
    planned = queues.queues(stack, teams, cloud)
    if not planned:  # no training pool on this cluster: nothing to queue for
        return None
    component = SharedQueues(f"{name}-queues", cloud, queues.flavors(stack, cloud), planned,
                             spec.clouds[groups[0].group.cloud].mirrors, opts=opts)
    return queues.OWN_QUEUE, [component.release, *component.local_queues]
