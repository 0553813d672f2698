"""Render a node group's user data from the templates and scripts in cloudinit/.

Templates are jinja2 with StrictUndefined (a missing value is an error, never an empty
string); long logic lives in real script files embedded through write_files. Two shapes of the
same content: a cloud-config (VM fleets, EKS nodes; `make userdata` writes this for every
group) and a shell script (ACK and TKE node pools run their user data as a script). Encoding
follows each cloud's field and size limit, gzip-compressing when the plain text is too big.
"""

from __future__ import annotations

import base64
import gzip
from dataclasses import asdict, dataclass
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path

import jinja2

from infra.groups import ResolvedGroup
from infra.spec import StackSpec

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "cloudinit"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)

# (path on the node, mode, source under cloudinit/; .j2 sources are rendered)
FILES = (
    ("/etc/gpu-training/node.env", "0644", "node.env.j2"),
    ("/usr/local/sbin/gts-bootstrap.sh", "0755", "scripts/gts-bootstrap.sh"),
    ("/usr/local/sbin/gts-driver.sh", "0755", "scripts/gts-driver.sh"),
    ("/usr/local/sbin/gts-runtime.sh", "0755", "scripts/gts-runtime.sh"),
    ("/usr/local/sbin/gts-nvme.sh", "0755", "scripts/gts-nvme.sh"),
    ("/usr/local/sbin/gts-disks.py", "0755", "scripts/gts-disks.py"),
    ("/usr/local/sbin/gts-dataset.sh", "0755", "scripts/gts-dataset.sh"),
    ("/usr/local/sbin/gts-spot-watch.py", "0755", "scripts/gts-spot-watch.py"),
    ("/etc/systemd/system/gts-bootstrap.service", "0644", "units/gts-bootstrap.service"),
    ("/etc/systemd/system/gts-trainer.service", "0644", "units/gts-trainer.service"),
    ("/etc/systemd/system/gts-spot-watch.service", "0644", "units/gts-spot-watch.service"),
    ("/etc/systemd/system/gts-exporters.service", "0644", "units/gts-exporters.service"),
)
# Limits on the user data field, in bytes of what the field holds.
LIMITS = {"aws": 16 * 1024, "alicloud": 32 * 1024, "tencentcloud": 16 * 1024}
DRIVER_BRANCH = "535"
METADATA_URLS = {"aws": "http://169.254.169.254", "alicloud": "http://100.100.100.200",
                 "tencentcloud": "http://metadata.tencentyun.com"}
DCGM_EXPORTER = "nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04"
NODE_EXPORTER = "prom/node-exporter:v1.8.2"


@dataclass(frozen=True)
class NodeContext:
    env: str
    cloud: str
    group: str
    mode: str  # vm | kubernetes
    image: str
    launcher: str
    workload_name: str
    checkpoint_url: str
    checkpoint_every: int
    dataset_url: str
    data_dir: str
    scratch_gb: int
    tmpfs_gb: int
    gpus: int
    nnodes: int
    nvswitch: bool
    driver_branch: str
    rdzv_endpoint: str
    mlflow_tracking_uri: str
    node_hourly_usd: str
    registry_mirror: str
    apt_mirror: str
    yum_mirror: str
    pip_mirror: str
    spot_action: str
    metadata_url: str  # the cloud's instance metadata service, polled for spot notices
    dcgm_exporter_image: str
    node_exporter_image: str


def node_context(spec: StackSpec, rg: ResolvedGroup) -> NodeContext:
    mirrors = spec.clouds[rg.group.cloud].mirrors
    registry = mirrors.registry or ""
    kube = rg.kind == "kubernetes"
    return NodeContext(
        env=spec.env, cloud=rg.cloud, group=rg.name, mode="kubernetes" if kube else "vm",
        image=spec.training.image, launcher=spec.training.launcher, workload_name=spec.training.workload,
        checkpoint_url=rg.checkpoint_url, checkpoint_every=spec.training.checkpoint_every,
        dataset_url=spec.training.dataset_url, data_dir="/scratch/datasets/current",
        scratch_gb=rg.scratch_gb, tmpfs_gb=spec.storage.dataset_tmpfs_gb, gpus=rg.gpus,
        nnodes=rg.nnodes, nvswitch=rg.primary.nvswitch, driver_branch=DRIVER_BRANCH,
        rdzv_endpoint=spec.training.rendezvous_endpoint or "",
        mlflow_tracking_uri=spec.training.mlflow_tracking_uri or "", node_hourly_usd=f"{rg.node_hourly_usd:.4f}",
        registry_mirror=registry, apt_mirror=mirrors.apt or "", yum_mirror=mirrors.yum or "",
        pip_mirror=mirrors.pip or "",
        spot_action="crictl:trainer" if kube else "docker:gts-trainer",
        metadata_url=METADATA_URLS[rg.cloud],
        dcgm_exporter_image=f"{registry or 'nvcr.io'}/{DCGM_EXPORTER}",
        node_exporter_image=f"{registry + '/' if registry else ''}{NODE_EXPORTER}",
    )


def _files(ctx: NodeContext) -> list[dict[str, str]]:
    out = []
    for path, mode, source in FILES:
        if source.endswith(".j2"):
            content = _ENV.get_template(source).render(**asdict(ctx))
        else:
            content = (TEMPLATE_DIR / source).read_text(encoding="utf-8")
        out.append({"path": path, "permissions": mode, "content": content.rstrip("\n")})
    return out


def render(ctx: NodeContext) -> str:
    """The node's cloud-config."""
    return _ENV.get_template("node.yaml.j2").render(**asdict(ctx), files=_files(ctx))


def render_script(ctx: NodeContext) -> str:
    """The same content as a shell script, for node pools that run their user data as one."""
    return _ENV.get_template("node.sh.j2").render(**asdict(ctx), files=_files(ctx))


def _fit(text: str, limit: int, what: str) -> bytes:
    """The bytes for a base64 field of `limit` bytes: plain when it fits, else gzip (cloud-init
    and the node pools' agents unpack it)."""
    raw = text.encode()
    if len(base64.b64encode(raw)) <= limit:
        return raw
    packed = gzip.compress(raw, mtime=0)
    if len(base64.b64encode(packed)) > limit:
        raise ValueError(f"{what}: user data is {len(packed)} bytes even gzipped, over the {limit}-byte limit")
    return packed


def for_vm(ctx: NodeContext) -> str:
    """Base64 user data for a VM fleet's launch template / scaling config / instance."""
    return base64.b64encode(_fit(render(ctx), LIMITS[ctx.cloud], f"{ctx.cloud}/{ctx.group}")).decode()


def for_eks(ctx: NodeContext) -> str:
    """Base64 MIME multi-part user data for an EKS managed node group's launch template
    (AL2023 nodeadm takes the cloud-config part; EKS adds its own NodeConfig)."""
    message = MIMEMultipart(boundary="==GTS==")
    message.attach(MIMEText(render(ctx), "cloud-config"))
    return base64.b64encode(_fit(message.as_string(), LIMITS["aws"], f"aws/{ctx.group}")).decode()


def for_node_pool_script(ctx: NodeContext) -> str:
    """Base64 shell-script user data for ACK and TKE node pools."""
    return base64.b64encode(_fit(render_script(ctx), LIMITS[ctx.cloud], f"{ctx.cloud}/{ctx.group}")).decode()
