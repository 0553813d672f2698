"""Render a node group's user data from the templates and scripts in cloudinit/.

Templates are jinja2 with StrictUndefined (a missing value is an error, never an empty
string); long logic lives in real script files embedded through write_files. Two shapes of the
same content: a cloud-config (VM fleets, EKS nodes; `make userdata` writes this for every
group) and a shell script (ACK and TKE node pools run their user data as a script).

The node settings (node.env) stay readable; every script and unit is embedded gzip+base64
(cloud-init's `encoding: gz+b64`, `base64 -d | gunzip` in the script shape), which keeps each
document under its field's limit without compressing the document itself: EKS refuses
user data that is not MIME multipart, and TKE runs the decoded bytes as a script.
"""

from __future__ import annotations

import ast
import functools
import base64
import gzip
import re
from dataclasses import dataclass, fields
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from typing import Any

import jinja2
import pulumi

from infra.buckets import bucket, endpoint
from infra.clouds import profile, profiles
from infra.core.errors import Problem
from infra.model.images import node_agents
from infra.model.spec import StackSpec
from infra.model.spec_patterns import ENV_SAFE, SECRET_MASK
from infra.render import bundle
from infra.rendezvous import Site
from infra.resolve import gpu_health
from infra.resolve.groups import ResolvedGroup, Stack
from infra.resolve.sharedfs import SharedFsOutputs, SharedMount, placeholder
from training import contract as c

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = ROOT / "cloudinit"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROOT)),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)

# What the user data itself carries: the node's settings, the fetcher, the node's own cloud's
# metadata module (its metadata service and object-store signing, which the fetcher reads) and
# the unit that runs the fetcher. Everything else comes in the node bundle (infra/render/bundle.py).
# (path on the node, mode, source under the repository; .j2 sources are rendered)
FILES = (
    ("/etc/gpu-training/node.env", "0600", "cloudinit/node.env.j2"),  # root's alone: every reader runs as root
    ("/usr/local/lib/gts/cloudmeta.py", "0755", "training/cloudmeta.py"),
    ("/etc/systemd/system/gts-fetch.service", "0644", "cloudinit/units/gts-fetch.service"),
)


def files_of(cloud: str) -> tuple[tuple[str, str, str], ...]:
    """FILES and the cloud's metadata module, where training/cloudmeta.py cloud_metadata finds it on a node."""
    name = profile(cloud).name  # a known cloud's name, never a path
    return (*FILES, (f"/usr/local/lib/gts/clouds/{name}/metadata.py", "0644", f"infra/clouds/{name}/metadata.py"))
# Limits on the user data field: (bytes, counted on "raw" text or on its "base64" form), with
# their sources in each cloud's profile (infra/clouds/<cloud>/profile.py user_data_limit); "eks":
# the smaller one of pool nodes whose service merges its own NodeConfig part into the same field.
LIMITS: dict[str, tuple[int, str]] = {p.name: p.user_data_limit for p in profiles()}
for _p in profiles():
    if _p.kubernetes_nodeadm and _p.kubernetes_user_data_limit is not None:
        LIMITS["eks"] = _p.kubernetes_user_data_limit
PLAIN_FILES = ("cloudinit/node.env.j2",)  # readable in the user data
DRIVER_BRANCH = "535"
METADATA_URLS = {p.name: p.metadata_url for p in profiles()}


# What a cluster node's env holds of the trainer contract: the fetcher's and the registry login's.
NODE_VARS = frozenset(v.name for v in (c.GTS_CLOUD, c.GTS_NODE_GROUP, c.STORAGE_ENDPOINT_URL, c.STORAGE_REGION,
                                       c.STORAGE_ADDRESSING_STYLE, c.STORAGE_CREDENTIALS))

STORE_HOST = "GTS_RDZV_HOST"  # gts-rdzv.service: the address the store binds
RDZV_KEY = "RDZV_KEY"  # a multi-node group's rendezvous key (training/node/rdzv_launch.py): Jobs get it from a Secret
RDZV_KEY_REF = "GTS_RDZV_KEY_REF"  # a VM node's: where its cloud's secret store holds it (infra/clouds/*/secrets.py)

# As long as any digest reference: the user data is sized with it before the image exists.
IMAGE_PLACEHOLDER = "registry.example/gpu-training-stack/trainer@sha256:" + "0" * 64


@dataclass(frozen=True)
class NodeContext:
    env: str
    cloud: str
    group: str
    mode: str  # vm | kubernetes | rendezvous
    image: str  # the trainer image, by digest
    scratch_gb: int
    tmpfs_gb: int
    nvswitch: bool
    driver_branch: str
    dockerhub_mirror: str
    apt_mirror: str
    nvidia_mirror: str
    spot_action: str
    metadata_url: str  # the cloud's instance metadata service, polled for spot notices
    dcgm_exporter_image: str
    node_exporter_image: str
    bundle_url: str  # the node bundle in the stack's bucket, and its pinned sha256
    bundle_sha256: str
    trainer: dict[str, str]  # the trainer contract (infra/contract.py)
    shared_fs: str = ""  # the shared file system's mount (gts-shared.sh): kernel type, source, options, path
    shared_source: str = ""
    shared_options: str = ""
    shared_dir: str = ""
    nvlinks: int = 0  # the GPU boot gate's expectations (infra/resolve/gpu_health.py; the GPU count is NPROC_PER_NODE)
    gpu_diag_level: int = 1
    replace: str = "group"  # none: fixed instances, no scaling group (infra/resolve/gpu_health.py replace_mode)


def store_context(spec: StackSpec, site: Site, image: str) -> NodeContext:
    """The rendezvous store instance's settings (infra/rendezvous.py): what the fetcher, the
    registry login and the store unit read; no GPU, scratch or trainer settings."""
    pinned = bundle.build()
    mirrors = spec.clouds[site.cloud].mirrors  # type: ignore[index]  # site.cloud is one of the clouds
    agents = node_agents(mirrors)
    b = bucket(spec, site.cloud)
    region = spec.region_of(spec.network(site.network))
    env = {c.GTS_CLOUD.name: site.cloud, c.GTS_NODE_GROUP.name: site.name,
           c.STORAGE_ENDPOINT_URL.name: endpoint(site.cloud, b.region, region), c.STORAGE_REGION.name: b.region,
           c.STORAGE_ADDRESSING_STYLE.name: "virtual",
           c.STORAGE_CREDENTIALS.name: profile(site.cloud).storage_credentials("vm"),
           STORE_HOST: site.address}  # the store listens on its private address alone
    return NodeContext(
        env=spec.env, cloud=site.cloud, group=site.name, mode="rendezvous", image=image, scratch_gb=0, tmpfs_gb=0,
        nvswitch=False, driver_branch=DRIVER_BRANCH, dockerhub_mirror=mirrors.docker_hub or "",
        apt_mirror=mirrors.apt or "", nvidia_mirror="", spot_action="", metadata_url=profile(site.cloud).metadata_url,
        dcgm_exporter_image=agents.dcgm_exporter, node_exporter_image=agents.node_exporter,
        bundle_url=f"s3://{b.name}/{pinned.key}", bundle_sha256=pinned.sha256, trainer=env)


def for_store(spec: StackSpec, site: Site, image: str = IMAGE_PLACEHOLDER) -> str:
    """Base64 cloud-config user data of a rendezvous store instance."""
    return for_vm(store_context(spec, site, image))


def node_context(spec: StackSpec, rg: ResolvedGroup, image: str, shared: SharedMount | None = None,
                 secrets: dict[str, str] | None = None) -> NodeContext:
    pinned = bundle.build()
    mirrors = spec.clouds[rg.group.cloud].mirrors
    agents = node_agents(mirrors)
    kube = rg.kind == "kubernetes"
    return NodeContext(
        env=spec.env, cloud=rg.cloud, group=rg.name, mode="kubernetes" if kube else "vm", image=image,
        scratch_gb=rg.scratch_gb, tmpfs_gb=spec.storage.dataset_tmpfs_gb, nvswitch=rg.primary.nvswitch,
        driver_branch=DRIVER_BRANCH, dockerhub_mirror=mirrors.docker_hub or "", apt_mirror=mirrors.apt or "",
        nvidia_mirror=mirrors.nvidia or "", spot_action="crictl:trainer" if kube else "docker:gts-trainer",
        metadata_url=profile(rg.cloud).metadata_url, dcgm_exporter_image=agents.dcgm_exporter,
        node_exporter_image=agents.node_exporter, bundle_url=f"s3://{rg.bucket.name}/{pinned.key}",
        # Cluster nodes run no trainer (the Job carries its env): they get what the fetcher needs.
        bundle_sha256=pinned.sha256, nvlinks=gpu_health.nvlinks(rg),
        gpu_diag_level=gpu_health.diag_level(rg), replace=gpu_health.replace_mode(rg),
        trainer={k: v for k, v in rg.trainer.items() if k in NODE_VARS} if kube else {**rg.trainer, **(secrets or {})},
        # A VM node mounts it for its trainer container; a cluster node hands its root to the
        # trainer's uid (gts-shared.sh --prepare), and pods mount it through a PersistentVolume.
        **({} if shared is None else {"shared_fs": shared.fs_type, "shared_source": shared.source,
                                      "shared_options": shared.options, "shared_dir": shared.path}),
    )


@functools.lru_cache(maxsize=32)
def compact_python(source: str) -> str:
    """The same program without docstrings, comments and what only a type checker reads: blocks
    under `if TYPE_CHECKING:`, function annotations and module-level variable annotations (never
    evaluated: the shipped modules have `from __future__ import annotations`; class bodies keep
    theirs, dataclasses read them). The user data carries it; the readable source is in the
    repository."""
    tree = ast.parse(source)
    tree.body = [ast.Assign(targets=[s.target], value=s.value, lineno=s.lineno)
                 if isinstance(s, ast.AnnAssign) and s.value is not None and s.simple else s
                 for s in tree.body if not (isinstance(s, ast.If) and isinstance(s.test, ast.Name)
                                            and s.test.id == "TYPE_CHECKING" and not s.orelse)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                        node.args.kwarg):
                if arg is not None:
                    arg.annotation = None
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return "#!/usr/bin/env python3\n" + ast.unparse(tree) + "\n"


@functools.lru_cache(maxsize=256)
def pack(text: str) -> str:
    """gzip + base64 on one line (wrapping would add a newline and the YAML indent every 76
    columns to a document with a size limit); reproducible: no gzip timestamp."""
    return base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()


def _values(ctx: NodeContext) -> dict[str, Any]:
    """The context's fields for the templates, as they are: the templates only read them, and
    `asdict` deep-copied them for every template of every group (issue 44)."""
    return {f.name: getattr(ctx, f.name) for f in fields(ctx)}


def _read(path: Path) -> str:
    """A node file's text; read once per version of the file (its mtime and size), not once per
    group: with compact_python and pack remembered per content too, a plan renders each static file
    once however many groups carry it (issue 44)."""
    st = path.stat()
    return _read_version(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _read_version(path: Path, mtime_ns: int, size: int) -> str:
    return path.read_text(encoding="utf-8")


def _files(ctx: NodeContext) -> list[dict[str, str]]:
    out = []
    for path, mode, source in files_of(ctx.cloud):
        if source.endswith(".j2"):
            content = _ENV.get_template(source).render(**_values(ctx))
        else:
            content = _read(ROOT / source)
        if source.endswith(".py"):
            content = compact_python(content)
        if source in PLAIN_FILES:
            out.append({"path": path, "permissions": mode, "content": content.rstrip("\n"), "encoding": ""})
        else:
            out.append({"path": path, "permissions": mode, "content": pack(content), "encoding": "gz+b64"})
    return out


class UnsafeEnvValue(ValueError):
    """A value that bash, systemd and docker would not all read as itself in node.env."""


_SAFE = re.compile(f"[{ENV_SAFE}]*")
_VAR = re.compile(r"[A-Z][A-Z0-9_]*")


def check_env(ctx: NodeContext) -> NodeContext:
    """Every value written to node.env in the alphabet the spec allows (infra/model/spec.py ENV_SAFE):
    the nodes' scripts source the file as root, systemd and docker read it without a shell, so
    one character outside it could run a command, override a later variable or read differently
    to the three. The spec refuses such values with their key; this stops any that a later
    change lets through before it reaches a node. (The offline plan's mask of a `secure:` value
    passes: a real run renders the decrypted value, which the spec has checked.)"""
    values = [(f"GTS_{k.upper()}", v) for k, v in _values(ctx).items() if isinstance(v, str)]
    for name, value in [*values, *ctx.trainer.items()]:
        if not _VAR.fullmatch(name) or not (_SAFE.fullmatch(value) or value == SECRET_MASK):
            raise UnsafeEnvValue(f"{ctx.cloud}/{ctx.group}: node.env {name}={value!r} holds characters a shell, "
                                 f"systemd or docker would read differently (allowed: {ENV_SAFE})")
    return ctx


def render_env(ctx: NodeContext) -> str:
    """The node's /etc/gpu-training/node.env alone."""
    return _ENV.get_template("cloudinit/node.env.j2").render(**_values(check_env(ctx)))


def render(ctx: NodeContext) -> str:
    """The node's cloud-config."""
    return _ENV.get_template("cloudinit/node.yaml.j2").render(**_values(check_env(ctx)), files=_files(ctx))


def render_script(ctx: NodeContext) -> str:
    """The same content as a shell script, for node pools that run their user data as one."""
    return _ENV.get_template("cloudinit/node.sh.j2").render(**_values(check_env(ctx)), files=_files(ctx))


class UserDataTooLarge(ValueError):
    """A node group's user data does not fit its cloud's field."""


def _check(data: bytes, limit: str, what: str) -> bytes:
    size, counted = LIMITS[limit]
    measured = len(data) if counted == "raw" else len(base64.b64encode(data))
    if measured > size:
        raise UserDataTooLarge(f"{what}: user data is {measured} bytes ({counted}), over the {size}-byte limit")
    return data


def for_vm(ctx: NodeContext) -> str:
    """Base64 user data for a VM fleet's launch template / scaling config / instance."""
    return base64.b64encode(_check(render(ctx).encode(), ctx.cloud, f"{ctx.cloud}/{ctx.group}")).decode()


def for_eks(ctx: NodeContext) -> str:
    """Base64 MIME multi-part user data for an EKS managed node group's launch template
    (AL2023 nodeadm takes the cloud-config part; EKS adds its own NodeConfig)."""
    message = MIMEMultipart(boundary="==GTS==")
    message.attach(MIMEText(render(ctx), "cloud-config"))
    return base64.b64encode(_check(message.as_string().encode(), "eks", f"{ctx.cloud}/{ctx.group}")).decode()


def for_node_pool_script(ctx: NodeContext) -> str:
    """Base64 shell-script user data for ACK and TKE node pools."""
    return base64.b64encode(_check(render_script(ctx).encode(), ctx.cloud, f"{ctx.cloud}/{ctx.group}")).decode()


def for_group(spec: StackSpec, rg: ResolvedGroup, image: str = IMAGE_PLACEHOLDER,
              shared: SharedMount | None = None, secrets: dict[str, str] | None = None) -> str:
    """The user data field value of a group's nodes, in the shape its kind of node takes; a
    group that mounts a shared file system whose address is not known yet gets a placeholder.
    `secrets` join a VM node's trainer env (where its rendezvous key is kept, never the key)."""
    fs = spec.shared_fs_of(rg.group)
    ctx = node_context(spec, rg, image, shared or (placeholder(fs) if fs else None), secrets)
    if rg.kind == "vm":
        return for_vm(ctx)
    return for_eks(ctx) if profile(rg.cloud).kubernetes_nodeadm else for_node_pool_script(ctx)


def for_cluster_group(spec: StackSpec, rg: ResolvedGroup, shared: SharedFsOutputs | None) -> pulumi.Output[str]:
    """A managed-Kubernetes GPU pool's user data, with no placeholder in it: cluster nodes run no
    trainer image (the Job does), and they prepare the network's shared file system (hand its
    root to the trainer's uid) at its real address once it is known. A type mounted through an
    access point (EFS) needs no preparing: the access point creates the root directory owned by
    the trainer's uid, and the file system policy admits mounts through it only
    (infra/clouds/aws/sharedfs.py)."""
    def render(mount: SharedMount | None) -> str:
        ctx = node_context(spec, rg, "", mount)
        return for_eks(ctx) if profile(rg.cloud).kubernetes_nodeadm else for_node_pool_script(ctx)

    if shared is None or not rg.group.shared_fs or shared.kind.access_point:
        return pulumi.Output.from_input(render(None))
    return shared.mount().apply(render)


def check_sizes(stack: Stack) -> list[Problem]:
    """Every group's user data against its field's limit, before anything is registered."""
    problems = []
    for rg in stack.groups:
        try:
            for_group(stack.spec, rg)
        except UserDataTooLarge as exc:
            problems.append(Problem(rg.path, f"{exc}; shorten the mirrors or settings it carries"))
    return problems
