"""The training pod's shape as plain data: what a group's trainer pod requests, the namespace it
runs in and the labels that tie Jobs, queues and teams together. The checks (infra/teams/queues.py,
through infra/validation.py) and the Kubernetes objects (infra/k8s/) both read it; it imports no
Pulumi code, so checking a spec loads no resource SDK (tests/test_check_phase.py)."""

from __future__ import annotations

import math

from infra.groups import ResolvedGroup

NAMESPACE = "training"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue's label naming a Job's LocalQueue
QUEUES_MANAGED = "gpu-training-stack/queues"  # namespaces whose Jobs Kueue manages (infra/k8s/queues.py)
LABEL_TEAM = "gpu-training-stack/team"
LABEL_CLOUD = "gpu-training-stack/cloud"
TRAINER_UID = 1000  # the image's USER (training/Dockerfile)
# What the node keeps for itself and its daemons (kubelet, runtime, exporters, device plugin).
CPU_SHARE, MEMORY_SHARE, SHM_SHARE = 0.85, 0.80, 0.25


def pod_resources(rg: ResolvedGroup) -> tuple[dict[str, str], int]:
    """(requests = limits, /dev/shm GiB) for a group's trainer pod, from its node type."""
    cpu = max(1, math.floor(rg.primary.vcpu * CPU_SHARE))
    memory = max(1, math.floor(rg.primary.ram_gib * MEMORY_SHARE))
    shm = max(1, math.floor(memory * SHM_SHARE))  # memory-backed: it counts against the limit
    return {"cpu": str(cpu), "memory": f"{memory}Gi", "nvidia.com/gpu": str(rg.gpus), **fabric_resources(rg)}, shm


# The extended resource each fabric's device plugin advertises (EKS: aws-efa-k8s-device-plugin,
# EKS user guide device-management-efa; ACK: the eRDMA controller, alibabacloud-erdma-controller).
FABRIC_RESOURCES = {"efa": "vpc.amazonaws.com/efa", "erdma": "aliyun/erdma"}
# libfabric's EFA provider allocates its bounce buffers from huge pages: the amount the awsome
# nccl-tests Job requests on p5.48xlarge (micro-benchmarks/nccl-tests/kubernetes/nccl-tests.yaml).
EFA_HUGEPAGES = "5120Mi"


def fabric_resources(rg: ResolvedGroup) -> dict[str, str]:
    """The trainer pod's fabric devices (all the node has) and what they need."""
    f = rg.fabric
    if f is None or f.fabric not in FABRIC_RESOURCES:
        return {}
    found = {FABRIC_RESOURCES[f.fabric]: str(f.devices)}
    if f.fabric == "efa":
        found["hugepages-2Mi"] = EFA_HUGEPAGES
    return found
