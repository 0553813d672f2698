"""policies/data/clouds.yaml: what the policy pack knows of each cloud, written from the profiles.

The pack runs in Pulumi's policy process and must not import the project, so it reads this data
file instead of asking infra/clouds/<cloud>/profile.py; `make policy-data` writes it and
tests/test_cloud_profiles.py fails when it is stale. A new cloud's row comes from its profile.

    python -m infra.clouds.packdata            # write policies/data/clouds.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from infra.clouds import profiles

PATH = Path(__file__).resolve().parents[2] / "policies" / "data" / "clouds.yaml"
HEADER = ("# Written by `make policy-data` (infra/clouds/packdata.py) from infra/clouds/<cloud>/profile.py:\n"
          "# edit the profile, not this file. Read by policies/gts_policy/clouds.py.\n")


def table() -> list[dict[str, Any]]:
    """One row per cloud, in the registry's order."""
    rows = []
    for p in profiles():
        disks = p.disk_encryption
        rows.append({"name": p.name, "displayName": p.display_name, "sdkPackage": p.sdk_package,
                     "instancePasswords": p.instance_passwords,
                     "dataDisks": None if disks is None else {
                         "key": disks.key, "encrypted": list(disks.encrypted),
                         "sdkGapPossible": disks.sdk_gap_possible}})
    return rows


def render() -> str:
    return HEADER + yaml.safe_dump({"clouds": table()}, sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    del argv
    PATH.write_text(render(), encoding="utf-8")
    print(PATH.relative_to(PATH.parents[2]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
