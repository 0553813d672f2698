"""What the teams tests share (tests/test_teams*.py): the Kueue objects' type tokens, a project
copy with the registry and its generated stacks, and `make teams` run in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.harness import ROOT, project_copy


CQ = "kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue"
LQ = "kubernetes:kueue.x-k8s.io/v1beta2:LocalQueue"
RF = "kubernetes:kueue.x-k8s.io/v1beta2:ResourceFlavor"


def teams_project(tmp: Path, edit: Any = None) -> Path:
    """A project copy with prod (the base and shared stack), the registry and its generated
    stacks; `edit(registry_dict)` changes teams.yaml first."""
    proj = project_copy(tmp)
    for name in ("Pulumi.dev.yaml", "Pulumi.prod.yaml", "Pulumi.team-vision.yaml", "teams.yaml"):
        shutil.copy(ROOT / name, proj / name)
    if edit is not None:
        data = yaml.safe_load((proj / "teams.yaml").read_text())
        edit(data)
        (proj / "teams.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return proj


def make_teams(proj: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`make teams` as the Makefile runs it, in the project copy."""
    env = {**os.environ, "PYTHONPATH": str(proj)}
    return subprocess.run([sys.executable, "-m", "infra.teams.report", *args], cwd=proj, capture_output=True,
                          text=True, timeout=300, env=env)
