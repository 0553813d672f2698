"""Render a node group's cloud-init user data from the templates in cloudinit/.

Templates are jinja2 with StrictUndefined: a missing value is an error, never an empty string.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2

from infra.spec import NodeGroup, StackSpec

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "cloudinit"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                          autoescape=False)


@dataclass(frozen=True)
class NodeContext:
    env: str
    cloud: str
    group: str
    workload: str
    image: str
    launcher: str
    checkpoint_url: str
    checkpoint_every: int
    dataset_url: str
    scratch_gb: int


def node_context(spec: StackSpec, group: NodeGroup, checkpoint_url: str) -> NodeContext:
    return NodeContext(
        env=spec.env, cloud=group.cloud, group=group.name, workload=group.workload,
        image=spec.training.image, launcher=spec.training.launcher,
        checkpoint_url=checkpoint_url, checkpoint_every=spec.training.checkpoint_every,
        dataset_url=spec.training.dataset_url, scratch_gb=spec.scratch_of(group).size_gb)


def render(ctx: NodeContext) -> str:
    return _ENV.get_template("node.yaml.j2").render(**asdict(ctx))


def render_base64(ctx: NodeContext) -> str:
    return base64.b64encode(render(ctx).encode()).decode()
