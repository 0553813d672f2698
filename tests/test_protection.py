"""Nothing is lost on `pulumi destroy`, a refactor or a mistaken edit: the resource options the
program registers (as the engine receives them) protect every stateful resource in prod and
none in dev, the policy pack catches one that is not, and a change that would make Pulumi
replace a stateful resource is marked before it happens (aliases keep refactors safe)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.plan.engine import Registered, run_program
from infra.plan.invokes import COMPUTED, INVOKES
from infra.plan.replacements import replacements
from infra.render import protection
from infra.stack.stackfile import StackConfig
from policies.gts_policy import rules
from policies.gts_policy.resources import Res
from tests.harness import ROOT, key, project_copy, shipped, stack_values, write_stack

STATEFUL = protection.stateful_types()


def unprotected(resources: list[Registered]) -> list[str]:
    """Stateful resources registered without protect (or, where they must be retained, without
    retainOnDelete)."""
    return [r.name for r in resources if r.type in STATEFUL
            and not (r.options["protect"] and (r.options["retainOnDelete"] or not STATEFUL[r.type].retain))]


# Shared file system types prod does not use (it has EFS); the test below gives prod one of each.
NOT_IN_PROD = {"aws:fsx/lustreFileSystem:LustreFileSystem", "alicloud:nas/fileSystem:FileSystem",
               "tencentcloud:Cfs/fileSystem:FileSystem"}


def test_prod_protects_every_stateful_resource_and_dev_none() -> None:
    prod = list(shipped("prod"))
    stateful = [r for r in prod if r.type in STATEFUL]
    assert {r.type for r in stateful} == set(STATEFUL) - NOT_IN_PROD, "every other kind listed is in prod"
    assert unprotected(prod) == []
    # Only those: the node-bundle object (replaced whenever the scripts change) and the bucket's
    # settings stay replaceable although Pulumi hands `protect` down to children.
    assert {r.type for r in prod if r.options["protect"]} == set(STATEFUL) - NOT_IN_PROD
    dev = list(shipped("dev"))
    assert not [r.name for r in dev if r.options["protect"] or r.options["retainOnDelete"]]


def test_every_kind_of_shared_file_system_is_protected_in_prod(tmp_path: Path) -> None:
    from tests.harness import run_stack

    def edit(values: dict[str, Any]) -> None:
        kinds = {"aws-train-west": {"type": "fsx-lustre", "sizeGb": 1200}, "ali-train": {"type": "nas"},
                 "tc-train": {"type": "cfs"}}
        for net in values[key("networks")]:
            if net["name"] in kinds:
                net["sharedFs"] = kinds[net["name"]]
    resources = run_stack("prod", edit, tmp_path)
    assert {r.type for r in resources} >= NOT_IN_PROD
    assert unprotected(resources) == []


def test_an_unprotected_stateful_resource_fails_the_check_and_the_policy() -> None:
    prod = list(shipped("prod"))
    (bucket,) = [r for r in prod if r.type == "aws:s3/bucket:Bucket"]
    stripped = [Registered(r.type, r.name, r.urn, r.parent, r.custom, r.provider, r.inputs, r.outputs,
                           {**r.options, "protect": False}) if r is bucket else r for r in prod]
    assert unprotected(stripped) == [bucket.name]
    views = [Res(r.type, r.name, r.inputs, bool(r.options["protect"])) for r in stripped]
    prod_config = json.loads((ROOT / "policies/prod.json").read_text())
    verdicts = rules.evaluate(views, prod_config)
    hits = [v for v in verdicts if v["policy"] == "stateful-protected"]
    assert len(hits) == 1 and hits[0]["enforcement"] == "mandatory" and bucket.name in hits[0]["resource"]
    assert "checkpoints, datasets" in hits[0]["message"]
    assert not [v for v in rules.evaluate([Res(r.type, r.name, r.inputs, bool(r.options["protect"])) for r in prod],
                                          prod_config) if v["policy"] == "stateful-protected"]


def test_the_pack_reads_the_same_stateful_list_as_the_program() -> None:
    assert (ROOT / "policies/data/stateful.yaml").read_text() == (ROOT / "infra/data/stateful.yaml").read_text(), \
        "copy infra/data/stateful.yaml to policies/data/ (the pack ships its own data)"


def test_kms_keys_wait_the_longest_window_and_buckets_are_never_force_emptied() -> None:
    """AWS KMS ScheduleKeyDeletion: 7-30 days (30 is the longest)."""
    for stack in ("dev", "prod"):
        res = list(shipped(stack))
        assert all(k.inputs["deletionWindowInDays"] == 30 for k in res if k.type == "aws:kms/key:Key")
        for r in res:
            if r.type == "aws:s3/bucket:Bucket" or r.type == "alicloud:oss/bucket:Bucket":
                assert r.inputs.get("forceDestroy") is False, r.name
            if r.type == "tencentcloud:Cos/bucket:Bucket":
                assert r.inputs.get("forceClean") is False, r.name


# ------------------------------------------------------------------ replacements before they happen

class Storage(pulumi.ComponentResource):
    def __init__(self, name: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("test:index:Storage", name, None, opts)
        pulumi.CustomResource("aws:s3/bucket:Bucket", f"{name}-bucket", {"bucket": "b"},
                              pulumi.ResourceOptions(parent=self))


def _plan(program: Any) -> list[dict[str, Any]]:
    res = run_program(StackConfig("gpu-training-stack", "t", {}), INVOKES, COMPUTED, program=program)
    return [{"type": r.type, "name": r.name, "urn": r.urn, "provider": r.provider, "inputs": r.inputs,
             "aliases": r.options["aliases"]} for r in res]


def test_a_renamed_component_keeps_its_bucket_with_an_alias_and_loses_it_without() -> None:
    stateful = {t: s.why for t, s in STATEFUL.items()}
    base = _plan(lambda: Storage("data"))
    aliased = _plan(lambda: Storage("datasets", pulumi.ResourceOptions(aliases=[pulumi.Alias(name="data")])))
    assert replacements(base, aliased, stateful) == []
    renamed = _plan(lambda: Storage("datasets"))
    (found,) = replacements(base, renamed, stateful)
    assert found["name"] == "data-bucket" and "add aliases" in found["why"] and "checkpoints" in found["why"]
    assert replacements(base, _plan(lambda: None), stateful)[0]["why"].startswith("it is no longer in the program")


def test_make_plan_against_an_earlier_plan_marks_a_bucket_rename(tmp_path: Path) -> None:
    """The command a reviewer runs: prod as shipped, then prod with another bucket prefix (bucket
    names cannot change in place on any of the three clouds)."""
    proj = project_copy(tmp_path)
    env = {"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin"}
    values = stack_values("prod")
    write_stack(proj, "prod", values)
    base = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", "prod", "--format", "json"], cwd=proj,
                          capture_output=True, text=True, timeout=300, env=env)
    assert base.returncode == 0, base.stderr
    (tmp_path / "base.json").write_text(base.stdout)
    plan = json.loads(base.stdout)
    guarded = {r["name"]: (r["protect"], r["retainOnDelete"]) for r in plan["resources"] if r["type"] in STATEFUL}
    assert guarded["prod-aws-storage-bucket"] == (True, True) and guarded["prod-aws-train-eks"] == (True, False)
    values[key("storage")]["bucketPrefix"] = "gts-prod-renamed"
    write_stack(proj, "prod", values)
    now = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", "prod", "--format", "json",
                          "--against", str(tmp_path / "base.json")], cwd=proj, capture_output=True, text=True,
                         timeout=300, env=env)
    found = json.loads(now.stdout)["replacements"]
    assert sorted(r["name"] for r in found) == ["prod-alicloud-storage-bucket", "prod-aws-storage-bucket",
                                                "prod-tencentcloud-storage-bucket"]
    assert all("bucket changes" in r["why"] for r in found)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_an_unchanged_stack_replaces_nothing(stack: str) -> None:
    rendered = [{"type": r.type, "name": r.name, "urn": r.urn, "provider": r.provider, "inputs": r.inputs,
                 "aliases": r.options["aliases"]} for r in shipped(stack)]
    assert replacements(rendered, rendered, {t: s.why for t, s in STATEFUL.items()},
                        {t: s.replace_on for t, s in STATEFUL.items()}) == []
