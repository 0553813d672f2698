"""One package per cloud with parallel module names (`infra/clouds/<cloud>/<concern>.py`), and
the one registry of them.

Outside this package no code names a cloud: it asks `profile(name)` (infra/clouds/profile.py
lists the questions; each cloud's `profile.py` answers them). An unknown name is an error, never
a fallback. Each cloud's `platform.py` defines a ComponentResource taking (name, stack) that
builds that cloud's part of the stack and offers `exports`.

This module imports only the profiles (plain data), so the spec itself can use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Literal, Protocol

from infra.clouds.alicloud.profile import AlicloudProfile
from infra.clouds.aws.profile import AwsProfile
from infra.clouds.profile import CloudProfile, MarketAnswers, SharedFsKind
from infra.clouds.tencentcloud.profile import TencentcloudProfile

# The stack file's cloud names, in the order messages and data files list them.
Cloud = Literal["aws", "alicloud", "tencentcloud"]
_PROFILES: dict[str, CloudProfile] = {p.name: p for p in (AwsProfile(), AlicloudProfile(), TencentcloudProfile())}
NAMES: tuple[str, ...] = tuple(_PROFILES)
# The fabric kinds (nodeGroups[].fabric) and shared file system types (networks[].sharedFs.type)
# the profiles answer, in the clouds' order: the spec's allowed values.
FABRICS: tuple[str, ...] = tuple(dict.fromkeys(p.fabric for p in _PROFILES.values()))
_SHARED_FS: dict[str, tuple[CloudProfile, SharedFsKind]] = {
    k.type: (p, k) for p in _PROFILES.values() for k in p.shared_fs_kinds}
SHARED_FS_TYPES: tuple[str, ...] = tuple(_SHARED_FS)


class UnknownCloud(KeyError):
    """A cloud name no profile answers for."""

    def __str__(self) -> str:
        return f"{self.args[0]!r} is not a cloud known here (known: {', '.join(NAMES)}; add one: docs/adding-a-cloud.md)"


def profile(name: str) -> CloudProfile:
    """The cloud's profile; UnknownCloud for a name that has none."""
    try:
        return _PROFILES[name]
    except KeyError:
        raise UnknownCloud(name) from None


def shared_fs(type_: str) -> tuple[CloudProfile, SharedFsKind]:
    """The cloud offering a shared file system type, and how that type mounts (the spec admits no
    other type)."""
    return _SHARED_FS[type_]


def profiles() -> Iterator[CloudProfile]:
    return iter(_PROFILES.values())


def by_provider(prefix: str) -> CloudProfile | None:
    """The cloud whose Pulumi provider owns a resource type-token prefix ("aws" of "aws:s3/...")."""
    return next((p for p in _PROFILES.values() if p.provider == prefix), None)


class Platform(Protocol):
    exports: dict[str, Any]

    def __init__(self, name: str, stack: Any, opts: Any = None) -> None: ...


def platform_class(cloud: str) -> type[Platform]:
    module, _, cls = profile(cloud).platform.partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


class _Scaling(Protocol):
    @property
    def max(self) -> int: ...


class _Grouped(Protocol):
    @property
    def cloud(self) -> str: ...

    @property
    def scaling(self) -> _Scaling: ...

    @property
    def market(self) -> MarketAnswers: ...

    @property
    def fabric(self) -> object | None: ...


def fixed_instances(group: _Grouped) -> int:
    """How many of a VM group's nodes are fixed instances outside any scaling group, as the
    group's cloud builds it: a question of its profile (no resource code loaded)."""
    return profile(group.cloud).fixed_instances(group.scaling.max, group.market, group.fabric is not None)
