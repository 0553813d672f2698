"""What the stack puts on every managed cluster once its node pools exist."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pulumi
import pulumi_kubernetes as k8s

from infra.groups import ResolvedGroup
from infra.images import node_agents
from infra.k8s.daemons import GpuNodeExporters, NvidiaDevicePlugin
from infra.k8s.job import Identity, deploy_training_jobs, training_namespace
from infra.sharedfs import SharedFsOutputs
from infra.spec import StackSpec


def cluster_workloads(name: str, kubeconfig: pulumi.Input[str], pools: Sequence[pulumi.Resource], spec: StackSpec,
                      groups: list[ResolvedGroup], parent: pulumi.Resource, device_plugin: bool,
                      trainer_images: Mapping[str, pulumi.Output[str]], identities: dict[str, Identity],
                      shared: SharedFsOutputs | None = None) -> k8s.Provider:
    """A Kubernetes provider on the new cluster (after its node pools exist, so the system pods
    have somewhere to run), the NVIDIA device plugin where the cloud does not install it, the GPU
    node exporters, the restricted training namespace and the training Jobs."""
    provider = k8s.Provider(f"{name}-k8s", kubeconfig=kubeconfig,
                            opts=pulumi.ResourceOptions(parent=parent, depends_on=list(pools)))
    opts = pulumi.ResourceOptions(parent=parent, provider=provider)
    images = node_agents(spec.clouds[groups[0].group.cloud].mirrors)
    if device_plugin:
        NvidiaDevicePlugin(f"{name}-nvidia", images.device_plugin, opts=opts)
    GpuNodeExporters(f"{name}-exporters", images, opts=opts)
    namespace = training_namespace(name, opts).metadata.name
    deploy_training_jobs(groups, trainer_images, identities, namespace, {"env": spec.env}, opts, shared)
    return provider
