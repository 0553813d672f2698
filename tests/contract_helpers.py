"""What the contract tests and the tests that feed a trainer the plan's own env share (tests/
test_contract.py, test_contract_handover.py, test_user_code.py, test_sharedfs.py,
test_training.py): dev's VM groups and prod's Jobs by name, a VM node's env file decoded from its
real user data, a Job container's env as the kubelet sets it, and a small image folder dataset."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from infra.plan.engine import Registered
from tests.harness import by_type, shipped
from tests.nodes import lay_down, node_env


VM_NODES = {  # dev's VM groups: (launch resource type, name)
    "aws": ("aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt"),
    "alicloud": ("alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate", "ali-train-lt"),
    "tencentcloud": ("tencentcloud:As/scalingConfig:ScalingConfig", "tc-train-config"),
}
JOBS = {"aws": "aws-eks-train-job", "alicloud": "ali-ack-train-job", "tencentcloud": "tc-tke-train-job"}


STORE_TYPES = {"aws": "aws:ec2/instance:Instance", "alicloud": "alicloud:ecs/instance:Instance",
               "tencentcloud": "tencentcloud:Instance/instance:Instance"}


def vm_env(stack: str, cloud: str, tmp: Path) -> dict[str, str]:
    """A VM node's /etc/gpu-training/node.env, from its user data as cloud-init writes it: the
    trainer container gets this file with `docker run --env-file` (gts-trainer.service)."""
    return node_env_of(list(shipped(stack)), cloud, tmp)


def node_env_of(resources: list[Registered], cloud: str, tmp: Path) -> dict[str, str]:
    """The same for the registrations of any (edited) stack."""
    type_token, name = VM_NODES[cloud]
    (node,) = [r for r in by_type(resources, type_token) if r.name == name]
    root = tmp / f"node-{cloud}"
    from infra.plan.engine import unwrap_secrets

    lay_down(base64.b64decode(unwrap_secrets(node.inputs["userData"])), root)  # secret: it holds the rendezvous key
    return node_env(root)


def job_containers(job: Registered) -> dict[str, dict[str, Any]]:
    pod = job.inputs["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*(pod.get("initContainers") or []), *pod["containers"]]}


def container_env(container: dict[str, Any], completion_index: int = 0) -> dict[str, str]:
    """A container's env as the kubelet sets it (the completion index from the pod's annotation;
    values from Secrets left out)."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in item["valueFrom"]:  # a Secret's value (RDZV_KEY): not the contract's
            continue
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            if path == "status.podIP":  # the pod's address (METRICS_ADDR): here, this machine's loopback
                env[item["name"]] = "127.0.0.1"
                continue
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']", path
            env[item["name"]] = str(completion_index)
    return env


def _image_folder() -> dict[str, bytes]:
    from io import BytesIO

    from PIL import Image

    files = {}
    for label, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
        for i in range(4):
            buf = BytesIO()
            Image.new("RGB", (40 + 4 * i, 36), colour).save(buf, format="JPEG")
            files[f"{label}/{i}.jpg"] = buf.getvalue()
    return files
