"""What the fabric tests (#30) share: a copy of prod with a 2-node p5.48xlarge group, a 2-node
Alibaba eRDMA group and a 2-node Tencent HCC group, planned by the real `make plan` code (JSON),
and readers for that plan's resources (tests/test_fabric.py, tests/test_fabric_kubernetes.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness import ROOT, key, project_copy, stack_values, write_stack


GROUPS = key("nodeGroups")


FABRIC_GROUPS = [
    {"name": "aws-efa", "cloud": "aws", "network": "aws-train", "instanceType": "p5.48xlarge",
     "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}},
    {"name": "ali-erdma", "cloud": "alicloud", "network": "ali-train", "instanceType": "ecs.ebmgn7ex.32xlarge",
     "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}},
    {"name": "tc-hcc", "cloud": "tencentcloud", "network": "tc-train", "instanceType": "HCCPNV4sne.32XLARGE1280",
     "scaling": {"min": 2, "max": 2}, "market": {"type": "on-demand"}},
]


def fabric_values() -> dict[str, Any]:
    values = stack_values("prod")
    values[GROUPS] += [dict(g) for g in FABRIC_GROUPS]
    values[key("budget")]["monthlyLimitUsd"] = 1_000_000  # three more 8-GPU pairs around the clock
    return values


def plan(tmp: Path, values: dict[str, Any], name: str = "fabric") -> subprocess.CompletedProcess[str]:
    proj = project_copy(tmp)
    (proj / "Pulumi.prod.yaml").write_text((ROOT / "Pulumi.prod.yaml").read_text())  # teams.yaml's base stack
    write_stack(proj, name, values)
    return subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv=['plan','--stack','" + name + "',"
                           "'--format','json']; runpy.run_module('infra.plan', run_name='__main__')"],
                          cwd=proj, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})


def resource(plan_json: dict[str, Any], type_token: str, name: str) -> dict[str, Any]:
    found = [r for r in plan_json["resources"] if r["type"] == type_token and r["name"] == name]
    assert len(found) == 1, sorted(r["name"] for r in plan_json["resources"] if r["type"] == type_token)
    return dict(found[0]["inputs"])


def of_type(plan_json: dict[str, Any], type_token: str) -> list[dict[str, Any]]:
    return [r for r in plan_json["resources"] if r["type"] == type_token]


def node_lib(tmp: Path) -> Path:
    """A GTS_LIB_DIR for the node scripts run in a test: the checkout's per-cloud fragments laid out
    as the bundle installs them (<lib>/clouds/<cloud>/fabric.sh, shared.sh), so a host that has an
    installed /usr/local/lib/gts never lends the test its fragments."""
    from infra import clouds

    lib = tmp / "gts-lib"
    for name in clouds.NAMES:
        folder = lib / "clouds" / name
        folder.mkdir(parents=True, exist_ok=True)
        for part in ("fabric.sh", "shared.sh"):
            shutil.copy(ROOT / "infra" / "clouds" / name / part, folder / part)
    return lib
