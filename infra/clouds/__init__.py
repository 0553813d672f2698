"""One package per cloud with parallel module names (`infra/clouds/<cloud>/<concern>.py`).

Each cloud's `platform.py` defines a ComponentResource taking (name, spec) that builds that
cloud's part of the stack and offers `exports`.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import pulumi

from infra.spec import NodeGroup, StackSpec


class Platform(Protocol):
    exports: dict[str, pulumi.Input[object]]

    def __init__(self, name: str, spec: StackSpec,
                 opts: pulumi.ResourceOptions | None = None) -> None: ...


_PLATFORMS = {
    "aws": "infra.clouds.aws.platform:AwsPlatform",
    "alicloud": "infra.clouds.alicloud.platform:AlicloudPlatform",
    "tencentcloud": "infra.clouds.tencentcloud.platform:TencentcloudPlatform",
}


def checkpoint_url(spec: StackSpec, group: NodeGroup) -> str:
    """A node group's checkpoint URL, from its cloud's storage module (the one naming the bucket)."""
    storage = importlib.import_module(f"infra.clouds.{group.cloud}.storage")
    return f"{storage.checkpoint_root(spec)}{group.name}/"


def platform_class(cloud: str) -> type[Platform]:
    module, _, cls = _PLATFORMS[cloud].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]
