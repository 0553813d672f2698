"""One package per cloud with parallel module names (`infra/clouds/<cloud>/<concern>.py`).

Each cloud's `platform.py` defines a ComponentResource taking (name, stack) that builds that
cloud's part of the stack and offers `exports`.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import pulumi

from infra.groups import ResolvedGroup, Stack


class Platform(Protocol):
    exports: dict[str, pulumi.Input[object]]

    def __init__(self, name: str, stack: Stack,
                 opts: pulumi.ResourceOptions | None = None) -> None: ...


_PLATFORMS = {
    "aws": "infra.clouds.aws.platform:AwsPlatform",
    "alicloud": "infra.clouds.alicloud.platform:AlicloudPlatform",
    "tencentcloud": "infra.clouds.tencentcloud.platform:TencentcloudPlatform",
}


def platform_class(cloud: str) -> type[Platform]:
    module, _, cls = _PLATFORMS[cloud].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def fixed_instances(group: ResolvedGroup) -> int:
    """How many of a VM group's nodes are fixed instances outside any scaling group, as the
    group's cloud builds it (infra/clouds/<cloud>/fleet.py fixed_instances)."""
    fleet = importlib.import_module(f"infra.clouds.{group.cloud}.fleet")
    return int(fleet.fixed_instances(group))
