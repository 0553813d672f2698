"""A cloud lives in one place: its profile (infra/clouds/<cloud>/profile.py), found through one
registry (`infra.clouds.profile`). Outside infra/clouds/ no code names a cloud; every cloud in the
registry answers every question the profile defines; a cloud that leaves a question (or a
platform step) out cannot be instantiated; an unknown cloud is an error, never a fallback."""

from __future__ import annotations

import ast
import importlib
import inspect
import ipaddress
from pathlib import Path
from typing import Any

import pytest

from infra import buckets, clouds
from infra.clouds import packdata
from infra.clouds.aws.profile import AwsProfile
from infra.clouds.base import CloudPlatform
from infra.clouds.profile import CloudProfile
from infra.prices import refresh
from policies.gts_policy import clouds as pack_clouds
from tests.harness import ROOT
from training import cloudmeta, storage
from training.contract import CREDENTIAL_SOURCES

NAMES = frozenset(clouds.NAMES)
SCANNED = ("infra", "policies", "training")
# Where a cloud's name may be written, and why.
EXEMPT = {
    "infra/clouds/": "the clouds' own packages and the registry",
    "training/cloudmeta.py": "node-side: runs on the node without infra/ (its metadata and credential endpoints)",
    "training/credentials.py": "node-side: runs on the node without infra/",
    "training/node/node_replace.py": "node-side: each cloud's replace-this-node call, run by the node's GPU health watch",
    # cloudinit/scripts/* are node-side too, and outside the scanned packages.
}
# Names still written outside the profiles, with why, and how many: one more fails the test.
KNOWN_LEFT: dict[str, int] = {}


def cloud_names_in(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is exactly a cloud's name."""
    return sorted((node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES)


def _named(exempt: tuple[str, ...] = tuple(EXEMPT)) -> dict[str, list[tuple[int, str]]]:
    found = {}
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "__pycache__" in path.parts or any(rel.startswith(e) for e in exempt):
                continue
            hits = cloud_names_in(path.read_text(encoding="utf-8"))
            if hits:
                found[rel] = hits
    return found


def test_no_code_outside_the_clouds_names_a_cloud() -> None:
    found = _named()
    left = {path: len(hits) for path, hits in found.items() if path in KNOWN_LEFT}
    assert {p: h for p, h in found.items() if p not in KNOWN_LEFT} == {}, \
        "ask infra.clouds.profile(<cloud>) instead (docs/adding-a-cloud.md)"
    assert left == KNOWN_LEFT


def test_the_name_finder_finds_comparisons_tables_and_literals() -> None:
    source = 'if cloud == "tencentcloud":\n    x = {"aws": 1}\nCloud = Literal["alicloud"]\ny = f"aws/{g}"\n'
    assert cloud_names_in(source) == [(1, "tencentcloud"), (2, "aws"), (3, "alicloud")]
    walked = _named(exempt=())  # without the exemptions the scan sees the clouds' own packages
    assert any(path.startswith("infra/clouds/") for path in walked), "is the scan walking the packages?"


def test_the_exempt_paths_exist() -> None:
    for path in [*EXEMPT, *KNOWN_LEFT]:
        assert (ROOT / path).exists(), path


# -- every cloud answers every question ------------------------------------------------------
QUESTIONS = sorted(CloudProfile.__abstractmethods__)
SAMPLE: dict[str, list[Any]] = {
    "kind": ["vm", "kubernetes"], "market": ["spot", "on-demand", "reserved"], "prefix": ["gts-ckpt"],
    "region": ["ap-guangzhou"], "app_id": ["1250000000", None], "bucket_region": ["eu-west-1"],
    "node_region": ["eu-west-1", "us-east-1"], "vpc": [ipaddress.IPv4Network("10.0.0.0/16")],
    "subnets": [[ipaddress.IPv4Network("10.0.0.0/24"), ipaddress.IPv4Network("10.0.1.0/24")]],
}


def _answers(p: CloudProfile, question: str) -> list[Any]:
    member = getattr(p, question)
    if not callable(member):
        return [member]
    params = list(inspect.signature(member).parameters)
    combos: list[list[Any]] = [[]]
    for name in params:
        combos = [c + [v] for c in combos for v in SAMPLE[name]]
    return [member(*args) for args in combos]


@pytest.mark.parametrize("cloud", clouds.NAMES)
def test_every_cloud_answers_every_question(cloud: str) -> None:
    p = clouds.profile(cloud)
    assert p.name == cloud and len(QUESTIONS) > 30
    for question in QUESTIONS:
        answers = _answers(p, question)
        assert answers, question
        assert all(a is not None or question in OPTIONAL for a in answers), f"{cloud}.{question}: {answers}"
        assert all(not isinstance(a, str) or a for a in answers), f"{cloud}.{question}: an empty answer"


OPTIONAL = {"app_id_missing", "operator_keys", "vpc_prefix_floor_192", "fabric_unbuildable",
            "kubernetes_pool_marks_rule", "kubernetes_user_data_limit", "disk_encryption"}


@pytest.mark.parametrize("cloud", clouds.NAMES)
def test_each_answer_is_one_the_next_part_reads(cloud: str) -> None:
    """The seams: the platform, fleet and price modules the profile names exist; its scheme,
    credential sources and metadata URL are ones the node-side code reads for this cloud."""
    p = clouds.profile(cloud)
    assert issubclass(clouds.platform_class(cloud), CloudPlatform)
    assert callable(importlib.import_module(p.fleet_module).fixed_instances)
    assert callable(refresh.refresher(cloud))
    assert p.storage_scheme in {*storage.ENDPOINTS, "s3"}
    assert {p.storage_credentials("vm"), p.storage_credentials("kubernetes")} <= set(CREDENTIAL_SOURCES)
    assert cloudmeta.CLOUDS[cloud].base_url == p.metadata_url
    assert p.fabric_placement("vm", "reserved") and p.fabric in ("efa", "erdma", "hcc")
    assert p.provider == cloud and clouds.by_provider(p.provider) is p
    mocks = importlib.import_module(p.mocks_module)  # the mock engine's answers for this provider
    assert mocks.INVOKES and mocks.COMPUTED
    assert {t.split(":")[0] for t in (*mocks.INVOKES, *mocks.COMPUTED)} == {p.provider}


def test_a_cloud_that_leaves_a_question_out_cannot_be_made() -> None:
    for missing in QUESTIONS:
        members = {q: getattr(AwsProfile, q) for q in QUESTIONS if q != missing}
        partial = type("Partial", (CloudProfile,), members)
        with pytest.raises(TypeError, match=missing):
            partial()
    whole = type("Whole", (CloudProfile,), {q: getattr(AwsProfile, q) for q in QUESTIONS})
    assert whole().name == "aws"


def test_a_platform_that_leaves_a_step_out_cannot_be_made() -> None:
    steps = sorted(CloudPlatform.__abstractmethods__)
    assert {"make_network", "make_fleet", "make_cluster", "make_budget", "make_registry"} <= set(steps)
    partial = type("Partial", (CloudPlatform,), {s: (lambda self, *a: None) for s in steps if s != "make_fleet"})
    with pytest.raises(TypeError, match="make_fleet"):
        partial("p", None)


def test_an_unknown_cloud_is_an_error_not_a_fallback() -> None:
    with pytest.raises(clouds.UnknownCloud, match="'gcp' is not a cloud known here.*adding-a-cloud"):
        clouds.profile("gcp")
    with pytest.raises(clouds.UnknownCloud):  # once the Tencent endpoint, silently
        buckets.endpoint("gcp", "eu-west-1", "eu-west-1")
    with pytest.raises(clouds.UnknownCloud):
        clouds.platform_class("gcp")


def test_the_packs_table_agrees_with_the_profiles() -> None:
    """The pack reads policies/data/clouds.yaml (it cannot import infra); `make policy-data`
    writes it from the profiles, and a stale copy fails here."""
    assert packdata.PATH.read_text(encoding="utf-8") == packdata.render(), "stale: run `make policy-data`"
    assert pack_clouds.load(packdata.render()) == pack_clouds.TABLE
    assert pack_clouds.CLOUDS == clouds.NAMES
    assert pack_clouds.PASSWORD_CLOUDS == {p.name for p in clouds.profiles() if p.instance_passwords}
    assert pack_clouds.CLOUD_NAMES == {p.name: p.display_name for p in clouds.profiles()}
    assert pack_clouds.SDK_PACKAGES == {p.provider: p.sdk_package for p in clouds.profiles()}
    assert clouds.NAMES == tuple(clouds.Cloud.__args__)  # type: ignore[attr-defined]


def test_the_profiles_import_nothing_of_the_project_but_their_base() -> None:
    """So that any module, the spec included, can ask a profile without an import cycle."""
    for cloud in clouds.NAMES:
        tree = ast.parse((ROOT / "infra" / "clouds" / cloud / "profile.py").read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert {m for m in imported if m and m.split(".")[0] in SCANNED} == {"infra.clouds.profile"}, cloud
    assert Path(clouds.__file__).read_text(encoding="utf-8").count("import infra.") == 0


def test_the_packs_disk_encryption_values_match_by_type() -> None:
    """Encrypted means the documented value: the boolean true (and Alibaba's "true"), never a 1
    that equals True in Python nor a string where the cloud takes a boolean."""
    by_cloud = {p.name: p.disk_encryption for p in clouds.profiles()}
    for name, disks in by_cloud.items():
        dd = pack_clouds.data_disks(name)
        assert (dd is None) == (disks is None), name
        if dd is None or disks is None:
            continue
        assert dd.is_encrypted(True) and not dd.is_encrypted(False) and not dd.is_encrypted(None), name
        assert not dd.is_encrypted(1) and not dd.is_encrypted("yes"), name
        assert dd.is_encrypted("true") == ("true" in disks.encrypted), name
    assert pack_clouds.data_disks("gcp") is None
