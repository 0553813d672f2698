"""The training pod's shape as plain data: what a group's trainer pod requests, the namespace it
runs in and the labels that tie Jobs, queues and teams together. The checks (infra/teams/queues.py,
through infra/checks/validation.py) and the Kubernetes objects (infra/k8s/) both read it; it imports no
Pulumi code, so checking a spec loads no resource SDK (tests/test_check_phase.py)."""

from __future__ import annotations

import math

from infra.clouds import profile
from infra.resolve.groups import ResolvedGroup

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


def fabric_resources(rg: ResolvedGroup) -> dict[str, str]:
    """The trainer pod's fabric devices (all the node has) and what they need, as the group's cloud
    answers (infra/clouds/<cloud>/profile.py fabric_pod_resources)."""
    f = rg.fabric
    return {} if f is None else profile(rg.cloud).fabric_pod_resources(f.devices)
