"""The check phase (infra/checks/validation.py: reading and checking a spec before any resource exists)
loads no Pulumi resource SDK, and the folders infra/k8s (Kubernetes objects) and infra/teams (the
registry and its queues as data) do not import each other both ways: infra/k8s uses the teams'
queues, infra/teams never the Kubernetes objects (the pod's shape it needs is infra/pods.py)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys

from tests.harness import ROOT
from tests.test_structure import _all_imports, _module_name

# The Pulumi provider packages infra/ imports (the Tencent one is tencentcloud_iac_pulumi).
RESOURCE_SDKS = ("pulumi_kubernetes", "pulumi_random", "pulumi_aws", "pulumi_alicloud", "tencentcloud_iac_pulumi",
                 "pulumi_docker_build")


def _chains(importtime: str, wanted: tuple[str, ...]) -> dict[str, list[str]]:
    """For each wanted top-level module `python -X importtime` shows, the chain of imports that
    loaded it first (a child line comes before its parent, one indent deeper)."""
    lines = [line.split("|")[-1] for line in importtime.splitlines() if line.startswith("import time:")][1:]
    entries = [((len(n) - len(n.lstrip())) // 2, n.strip()) for n in lines]
    found: dict[str, list[str]] = {}
    for i, (depth, name) in enumerate(entries):
        if name not in wanted or name in found:
            continue
        chain, level = [name], depth
        for parent_depth, parent in entries[i + 1:]:
            if parent_depth < level:
                chain.insert(0, parent)
                level = parent_depth
        found[name] = chain
    return found


def _loaded_by(module: str) -> dict[str, list[str]]:
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return _chains(run.stderr, RESOURCE_SDKS)


def test_the_check_phase_loads_no_resource_sdk() -> None:
    loaded = _loaded_by("infra.checks.validation")
    assert loaded == {}, "infra.checks.validation loads " + "; ".join(" -> ".join(c) for c in loaded.values())


def test_the_import_chains_are_read_from_importtime() -> None:
    """The chain finder names the path a module came through (the test above can fail usefully)."""
    loaded = _loaded_by("infra.k8s.daemons")
    assert loaded["pulumi_kubernetes"][0] == "infra.k8s.daemons"
    assert loaded["pulumi_kubernetes"][-1] == "pulumi_kubernetes"


def _imports_of(folder: str, other: str) -> list[str]:
    """`module -> imported` for each import, wherever it is (module level, function, TYPE_CHECKING),
    from a module of infra/<folder> into infra/<other>."""
    out = []
    for path in sorted((ROOT / "infra" / folder).rglob("*.py")):
        name = _module_name(path)
        for m in sorted(_all_imports(path, name)):
            if m == f"infra.{other}" or m.startswith(f"infra.{other}."):
                out.append(f"{name} -> {m}")
    return out


def test_k8s_and_teams_do_not_import_each_other() -> None:
    forward, back = _imports_of("k8s", "teams"), _imports_of("teams", "k8s")
    assert not (forward and back), f"a folder loop: {forward} and back {back}"
    assert back == [], f"infra/teams imports infra/k8s (Kubernetes objects; the pod's shape is infra/pods.py): {back}"


def test_the_folder_walk_sees_local_and_typing_imports() -> None:
    """infra/teams/report.py imports infra.plan inside a function: the walk counts it."""
    assert "infra.teams.report -> infra.plan.engine" in _imports_of("teams", "plan")


def _provider_imports() -> set[str]:
    """The top-level provider packages (pulumi_* or tencentcloud_iac_pulumi) any infra/ module imports."""
    found = set()
    for path in (ROOT / "infra").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found |= {n.split(".")[0] for n in names if n.startswith("pulumi_") or n.startswith("tencentcloud_")}
    return found


def test_the_resource_sdks_are_the_installed_providers_infra_imports() -> None:
    """A misspelt or missing entry would make the check above pass for nothing."""
    assert [n for n in RESOURCE_SDKS if importlib.util.find_spec(n) is None] == []
    assert set(RESOURCE_SDKS) == _provider_imports()


def test_the_dockerfile_names_where_its_settings_live() -> None:
    """training/Dockerfile's `(path NAME)` notes name a file that defines NAME (TRAINER_UID is infra/pods.py's)."""
    text = (ROOT / "training" / "Dockerfile").read_text(encoding="utf-8")
    notes = re.findall(r"\(([\w/]+\.py) ([A-Z_]+)\)", text)
    assert ("infra/pods.py", "TRAINER_UID") in notes
    for path, name in notes:
        source = ROOT / path
        assert source.exists() and re.search(rf"^{name}\b", source.read_text(encoding="utf-8"), re.M), (path, name)


_RUN_THE_CHECKS = """
import sys
from infra.resolve import gpu_health, spares
from infra.resolve.groups import resolve
from tests.harness import key, parse_spec, spec_raw, stack_values

config = stack_values("prod")
for group in config[key("nodeGroups")]:  # spares where they work: the spare checks ask about fixed instances
    if group["name"] in ("aws-train", "ali-train", "tc-train"):
        group["scaling"] = {"min": 2, "max": 4, "desired": 4, "spares": 1}
        group.pop("schedule", None)
stack = resolve(parse_spec(spec_raw(config)))
for rg in stack.groups:
    gpu_health.replace_mode(rg), spares.problems(rg)
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[1:])))
"""


def test_the_checks_at_run_time_load_no_resource_sdk() -> None:
    """Not only the imports: running the checks (spares, the GPU watch's mode, which ask how many of
    a group's nodes are fixed instances) loads no cloud's fleet module and no provider SDK."""
    run = subprocess.run([sys.executable, "-c", _RUN_THE_CHECKS, *RESOURCE_SDKS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [], f"running the checks loaded {run.stdout.strip()}"
