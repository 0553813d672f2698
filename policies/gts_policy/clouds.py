"""The policy pack's one table of clouds: every cloud name the pack knows is here.

The pack runs in Pulumi's policy process with its own requirements and must not import the
project (infra/), so it cannot ask infra/clouds/<cloud>/profile.py. It keeps this small table
instead, and tests/test_cloud_profiles.py checks that it agrees with the profiles (names,
display names, SDK packages): adding a cloud means a row here, not edits across the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DataDisks:
    """How a cloud's instances, scaling configurations and node pools encrypt their data disks."""

    key: str  # the dataDisks[] item's key that encrypts the disk
    is_encrypted: Callable[[object], bool]  # which values of it count as encrypted
    # The pinned SDK may lack the key for some resource types (data/capabilities.yaml sdkGaps
    # "dataDiskEncryption"), and the disks may sit in autoScalingConfig.dataDisks instead.
    sdk_gap_possible: bool


@dataclass(frozen=True)
class PackCloud:
    name: str  # the stack's cloud name and the provider's type-token prefix
    display_name: str
    sdk_package: str  # the provider SDK (which resource classes take `tags`)
    instance_passwords: bool  # its instances take a login password argument (refused)
    data_disks: DataDisks | None  # None: disks are checked per resource type in rules.py


TABLE: dict[str, PackCloud] = {c.name: c for c in (
    PackCloud("aws", "AWS", "pulumi_aws", instance_passwords=False, data_disks=None),
    PackCloud("alicloud", "Alibaba Cloud", "pulumi_alicloud", instance_passwords=True,
              data_disks=DataDisks("encrypted", lambda v: v in (True, "true"), sdk_gap_possible=False)),
    PackCloud("tencentcloud", "Tencent Cloud", "tencentcloud_iac_pulumi", instance_passwords=True,
              data_disks=DataDisks("encrypt", lambda v: v is True, sdk_gap_possible=True)),
)}
CLOUDS = tuple(TABLE)
CLOUD_NAMES = {c.name: c.display_name for c in TABLE.values()}
SDK_PACKAGES = {c.name: c.sdk_package for c in TABLE.values()}
PASSWORD_CLOUDS = frozenset(c.name for c in TABLE.values() if c.instance_passwords)


def data_disks(cloud: str) -> DataDisks | None:
    found = TABLE.get(cloud)
    return found.data_disks if found is not None else None
