"""Images the nodes pull besides the trainer, and where they come from.

On nodes whose cloud account names a registry mirror (`clouds.<cloud>.mirrors.registry`, e.g. a
China-region registry holding copies), every image is pulled through it; elsewhere from its
upstream registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.model.spec import Mirrors

DCGM_EXPORTER = "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04"
NODE_EXPORTER = "docker.io/prom/node-exporter:v1.8.2"
DEVICE_PLUGIN = "nvcr.io/nvidia/k8s-device-plugin:v0.17.2"
CLUSTER_AUTOSCALER = "registry.k8s.io/autoscaling/cluster-autoscaler:v1.35.2"


def pulled(image: str, mirrors: Mirrors) -> str:
    """`image` as this cloud's nodes pull it: through the registry mirror when one is set
    (the upstream registry host replaced, the repository path kept)."""
    if not mirrors.registry:
        return image
    _, _, path = image.partition("/")
    return f"{mirrors.registry}/{path}"


@dataclass(frozen=True)
class NodeAgents:
    dcgm_exporter: str
    node_exporter: str
    device_plugin: str


def node_agents(mirrors: Mirrors) -> NodeAgents:
    return NodeAgents(pulled(DCGM_EXPORTER, mirrors), pulled(NODE_EXPORTER, mirrors), pulled(DEVICE_PLUGIN, mirrors))
