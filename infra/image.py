"""The trainer image, built by the stack from training/Dockerfile on the base image the spec
pins (`training.image`, by digest) and pushed into each cloud's own registry, so that nodes pull
it from their cloud (mainland China nodes never from nvcr.io or Docker Hub at run time). Every
VM and Job references it by digest. A stack may name a prebuilt image per cloud instead
(`training.prebuiltImages`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_docker_build as docker_build

from infra import clouds

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = "training/Dockerfile"
# What the image carries besides its base: the trainer and each cloud's node-side modules.
# training/Dockerfile.dockerignore lets exactly these through, each by its own name: a `!` line
# with a wildcard makes BuildKit walk every excluded folder of the context (.git, .venv, ...) on
# each build, and an old builder skipped the excluded folder instead (tests/test_cloud_profiles.py
# keeps the two lists equal).
SOURCES = ("training", *(f"infra/clouds/{cloud}/{part}.py" for cloud in clouds.NAMES for part in ("metadata", "node")))


def _inputs(root: Path) -> list[Path]:
    """The files SOURCES names: a file, every file under a folder, or a pattern's matches."""
    found: list[Path] = []
    for src in (DOCKERFILE, *SOURCES):
        path = root / src
        found += sorted(root.glob(src)) if "*" in src else [path] if path.is_file() else list(path.rglob("*"))
    return sorted(p for p in found if p.is_file() and "__pycache__" not in p.parts)


def content_tag(base_image: str, root: Path = ROOT) -> str:
    """A tag naming the image's inputs: the base image and every file copied into it. The same
    sources give the same tag, so an unchanged trainer is not pushed again."""
    digest = hashlib.sha256(base_image.encode())
    for path in _inputs(root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return "t-" + digest.hexdigest()[:16]


def image_resource_name(platform: str, base_image: str, default_base: str) -> str:
    """The stack's own base keeps the name it always had; a group's own base gets one derived
    from it, so adding or removing a group's image renames no other image."""
    if base_image == default_base:
        return f"{platform}-trainer"
    return f"{platform}-trainer-{hashlib.sha256(base_image.encode()).hexdigest()[:8]}"


def registry_name(env: str) -> str:
    """A registry instance's name: it becomes a global domain (<name>.tencentcloudcr.com,
    <name>-registry.<region>.cr.aliyuncs.com), so it carries a suffix from the organization,
    project and stack, not the stack's name alone."""
    scope = f"{pulumi.get_organization()}/{pulumi.get_project()}/{pulumi.get_stack()}"
    return f"gts-{env}-{hashlib.sha256(scope.encode()).hexdigest()[:6]}"


@dataclass
class Registry:
    """Where one cloud's copy of the image goes: pushed through `push_repository` (reachable from
    where `pulumi up` runs) and pulled by the nodes through `pull_repository` (the same
    repository on the cloud's private network where it has one)."""

    push_repository: pulumi.Output[str]
    pull_repository: pulumi.Output[str]
    address: pulumi.Output[str]
    username: pulumi.Output[str]
    password: pulumi.Output[str]


@dataclass
class TrainerImageArgs:
    base_image: str
    registry: Registry
    # Explicit, because the stack files disable default providers (`pulumi:disable-default-providers:
    # ["*"]`) and a denied default provider cannot be used: every build would fail at `up`
    # (pulumi/pulumi#8829; Pulumi docs, "Disable default providers").
    provider: pulumi.ProviderResource


def build_provider(name: str, parent: pulumi.Resource) -> pulumi.ProviderResource:
    """The docker-build provider the cloud's images build with (one per cloud)."""
    return docker_build.Provider(f"{name}-docker-build", opts=pulumi.ResourceOptions(parent=parent))


class TrainerImage(pulumi.ComponentResource):
    ref: pulumi.Output[str]  # <pull repository>@sha256:<digest>

    def __init__(self, name: str, args: TrainerImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:index:TrainerImage", name, None, opts)
        reg = args.registry
        tag = content_tag(args.base_image)
        # Paths relative to the project (where `pulumi up` runs): absolute ones would differ between
        # checkouts, rebuild and re-push the same tag, which an immutable repository refuses.
        self.image = docker_build.Image(
            f"{name}-image", context=docker_build.BuildContextArgs(location="."),
            dockerfile=docker_build.DockerfileArgs(location=DOCKERFILE),
            build_args={"BASE_IMAGE": args.base_image}, platforms=[docker_build.Platform.LINUX_AMD64],
            push=True, build_on_preview=False, tags=[reg.push_repository.apply(lambda r: f"{r}:{tag}")],
            registries=[docker_build.RegistryArgs(address=reg.address, username=reg.username,
                                                  password=pulumi.Output.secret(reg.password))],
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider))
        self.ref = pulumi.Output.all(reg.pull_repository, self.image.digest).apply(lambda rd: f"{rd[0]}@{rd[1]}")
        self.register_outputs({"ref": self.ref})
