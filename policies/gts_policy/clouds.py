"""The policy pack's table of clouds, as policies/data/clouds.yaml lists them.

The pack runs in Pulumi's policy process with its own requirements and must not import the
project (infra/), so it cannot ask infra/clouds/<cloud>/profile.py. `make policy-data` writes
that file from the profiles (infra/clouds/packdata.py) and tests/test_cloud_profiles.py fails
when it is stale: adding a cloud means its profile, not edits across the rules. Read once, when
the pack is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True)
class DataDisks:
    """How a cloud's instances, scaling configurations and node pools encrypt their data disks."""

    key: str  # the dataDisks[] item's key that encrypts the disk
    encrypted: tuple[bool | str, ...]  # the values of it that count as encrypted
    # The pinned SDK may lack the key for some resource types (data/capabilities.yaml sdkGaps
    # "dataDiskEncryption"), and the disks may sit in autoScalingConfig.dataDisks instead.
    sdk_gap_possible: bool

    def is_encrypted(self, value: object) -> bool:
        """`value` is one of `encrypted`: a bool by identity (1 is not true here), a string by equality."""
        return any(value is v if isinstance(v, bool) else (isinstance(value, str) and value == v)
                   for v in self.encrypted)


@dataclass(frozen=True)
class PackCloud:
    name: str  # the stack's cloud name and the provider's type-token prefix
    display_name: str
    sdk_package: str  # the provider SDK (which resource classes take `tags`)
    instance_passwords: bool  # its instances take a login password argument (refused)
    data_disks: DataDisks | None  # None: disks are checked per resource type in rules_security.py


def _flag(mapping: dict[str, Any], key: str) -> bool:
    """A yes/no field: YAML's true or false, never a string ("false" would read as true)."""
    value = mapping[key]
    if not isinstance(value, bool):
        raise ValueError(f"policies/data/clouds.yaml: {key} is {value!r}, not true or false (run `make policy-data`)")
    return value


def _row(row: dict[str, Any]) -> PackCloud:
    disks = row["dataDisks"]
    return PackCloud(str(row["name"]), str(row["displayName"]), str(row["sdkPackage"]), _flag(row, "instancePasswords"),
                     None if disks is None else DataDisks(str(disks["key"]), tuple(disks["encrypted"]),
                                                          _flag(disks, "sdkGapPossible")))


def load(text: str) -> dict[str, PackCloud]:
    return {c.name: c for c in map(_row, yaml.safe_load(text)["clouds"])}


TABLE: dict[str, PackCloud] = load((DATA_DIR / "clouds.yaml").read_text(encoding="utf-8"))
CLOUDS = tuple(TABLE)
CLOUD_NAMES = {c.name: c.display_name for c in TABLE.values()}
SDK_PACKAGES = {c.name: c.sdk_package for c in TABLE.values()}
PASSWORD_CLOUDS = frozenset(c.name for c in TABLE.values() if c.instance_passwords)


def data_disks(cloud: str) -> DataDisks | None:
    found = TABLE.get(cloud)
    return found.data_disks if found is not None else None
