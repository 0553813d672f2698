"""A cloud lives in one place: its profile (infra/clouds/<cloud>/profile.py), found through one
registry (`infra.clouds.profile`), and its node-side modules (metadata.py, node.py), found through
one loader (training/cloudmeta.py). Outside infra/clouds/ no code names a cloud, the node's code
included; every cloud in the registry answers every question the profile and the node-side
interfaces define; a cloud that leaves a question (or a platform step) out cannot be
instantiated; an unknown cloud is an error, never a fallback."""

from __future__ import annotations

import ast
from collections.abc import Callable
import re
import shutil
import importlib
import inspect
import ipaddress
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import pytest

from infra import buckets, clouds, image
from infra.clouds import packdata
from infra.clouds.aws.profile import AwsProfile
from infra.clouds.base import CloudPlatform
from infra.clouds.profile import CloudProfile
from infra.model.spec_capacity import Market
from infra.prices import refresh
from policies.gts_policy import clouds as pack_clouds
from tests.harness import ROOT
from tests.shell_code import shell_code, unit_code
from tests.test_node_fragments import GENERIC_MOUNTS
from training import cloudmeta
from training.ckpt import storage
from training.contract import CREDENTIAL_SOURCES

if TYPE_CHECKING:
    from training.cloudmeta import CloudMetadata, CloudNode

# The clouds' names, and the fabric kinds and shared file system types: each of these stands for
# one cloud (its profile answers it: infra/clouds/<cloud>/profile.py fabric, shared_fs_kinds).
# The kernel types a shared file system mounts as stand for a cloud too, but for the NFS ones
# gts-shared.sh mounts for every cloud (tests/test_node_fragments.py GENERIC_MOUNTS).
MOUNT_TYPES = frozenset(k.mount_type for p in clouds.profiles() for k in p.shared_fs_kinds) - set(GENERIC_MOUNTS)
NAMES = frozenset(clouds.NAMES) | frozenset(clouds.FABRICS) | frozenset(clouds.SHARED_FS_TYPES) | MOUNT_TYPES
SCANNED = ("infra", "policies", "training", "cloudinit")  # cloudinit: the node scripts, templates and units
# Python by its string constants; shell, templates, units and Dockerfiles by their words
READ = ("*.py", "*.sh", "*.j2", "*.service", "Dockerfile")
# Where a cloud's name may be written, and why.
EXEMPT = {
    "infra/clouds/": "the clouds' own packages (node-side modules included) and the registry",
}
# Names still written outside the profiles, with why, and how many: one more fails the test.
KNOWN_LEFT: dict[str, int] = {}


def cloud_names_in(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is exactly a cloud's name, fabric or shared file system."""
    return sorted((node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES)


# A name as a word or a word's start: `erdma_*`, `${GTS_FABRIC:-efa}`, `aws-efa` count; a part of a
# longer word (`amazonaws`, `efa2`) or a host name (`x.efa`) does not.
_WORD = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, NAMES), key=len, reverse=True)) + r")(?![a-z0-9])")


def shell_names_in(source: str, kind: str = "shell") -> list[tuple[int, str]]:
    """(line, name) of every word of a shell script or Dockerfile (comments aside, quote-aware), a
    systemd unit (comments and descriptions aside) or a template that is one of the names: a case
    label, a test's operand, a default, a word in a message."""
    readers: dict[str, Callable[[str], str]] = {"shell": shell_code, "unit": unit_code, "template": str}
    code = readers[kind](source)
    return [(n, m.group(1)) for n, line in enumerate(code.splitlines(), start=1) for m in _WORD.finditer(line)]


def _names_in(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return cloud_names_in(text)
    return shell_names_in(text, {".j2": "template", ".service": "unit"}.get(path.suffix, "shell"))


def _named(exempt: tuple[str, ...] = tuple(EXEMPT), scanned: tuple[str, ...] = SCANNED) -> dict[str, list[tuple[int, str]]]:
    found = {}
    for pkg in scanned:
        for path in sorted(p for pattern in READ for p in (ROOT / pkg).rglob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            if "__pycache__" in path.parts or any(rel.startswith(e) for e in exempt):
                continue
            hits = _names_in(path)
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
    kinds = 'if f.fabric == "efa":\n    m = {"fsx-lustre": 1}\nT = Literal["auto", "hcc"]\nd = "efa-only"\n'
    assert cloud_names_in(kinds) == [(1, "efa"), (2, "fsx-lustre"), (3, "hcc")]
    shell = ('# efa | erdma: a comment\ncase $F in\n  efa) x ;;\n  erdma) y=x ;;  # hcc\nesac\n'
             '[ "$F" = hcc ] && log "nfs, not nas"\ncurl https://x.efa.example/amazonaws/efa2.tgz\n')
    assert shell_names_in(shell) == [(3, "efa"), (4, "erdma"), (6, "hcc"), (6, "nas")]
    assert shell_names_in('{% if fabric == "efs" %}# aws\n', "template") == [(1, "efs"), (1, "aws")]
    # a kind after a quoted `#`, as a default, as a word's start, a mount type; a unit's and a
    # Dockerfile's words (their comments and descriptions aside)
    planted = ('log "a hash # then erdma"\nF=${GTS_FABRIC:-efa}\ncase $n in erdma_*) ;; esac\n'
               'mount -t lustre x /y\nx=aws-efa  # cfs\n')
    assert shell_names_in(planted) == [(1, "erdma"), (2, "efa"), (3, "erdma"), (4, "lustre"), (5, "aws"), (5, "efa")]
    unit = "[Unit]\nDescription=efa watcher\n# aws\n[Service]\nExecStart=/bin/x --fabric=hcc\n"
    assert shell_names_in(unit, "unit") == [(5, "hcc")]
    assert shell_names_in("FROM x\n# tencentcloud\nENV GTS_FABRIC=efa\n") == [(3, "efa")]
    assert {"cloudinit/units/gts-trainer.service", "training/Dockerfile"} <= {
        p.relative_to(ROOT).as_posix() for pkg in SCANNED for pattern in READ for p in (ROOT / pkg).rglob(pattern)}
    walked = _named(exempt=())  # without the exemptions the scan sees the clouds' own packages
    assert any(path.startswith("infra/clouds/") for path in walked), "is the scan walking the packages?"
    assert {p.relative_to(ROOT).as_posix() for p in (ROOT / "cloudinit").rglob("*.py")} >= {
        "cloudinit/scripts/gts-spot-watch.py", "cloudinit/scripts/gts-gpu-health.py"}, "are the node scripts scanned?"
    read = {p.relative_to(ROOT).as_posix() for pattern in READ for p in (ROOT / "cloudinit").rglob(pattern)}
    assert {"cloudinit/scripts/gts-fabric.sh", "cloudinit/scripts/gts-lib.sh", "cloudinit/node.yaml.j2"} <= read
    # what the node scripts do per cloud is in its fragments there (gts-lib.sh cloud_fragment)
    assert {"infra/clouds/aws/fabric.sh", "infra/clouds/alicloud/fabric.sh"} <= set(walked)


def test_the_exempt_paths_exist() -> None:
    for path in [*EXEMPT, *KNOWN_LEFT]:
        assert (ROOT / path).exists(), path


# -- every cloud answers every question ------------------------------------------------------
QUESTIONS = sorted(CloudProfile.__abstractmethods__)
SAMPLE: dict[str, list[Any]] = {
    "kind": ["vm", "kubernetes"], "market": [Market(type=t) for t in get_args(Market.model_fields["type"].annotation)], "prefix": ["gts-ckpt"],
    "region": ["ap-guangzhou"], "app_id": ["1250000000", None], "bucket_region": ["eu-west-1"],
    "node_region": ["eu-west-1", "us-east-1"], "vpc": [ipaddress.IPv4Network("10.0.0.0/16")],
    "subnets": [[ipaddress.IPv4Network("10.0.0.0/24"), ipaddress.IPv4Network("10.0.1.0/24")]],
    "interfaces": [0, 1, 4], "devices": [1, 4], "primary_every": [0, 4], "nodes": [2], "vpc_cidr": ["10.0.0.0/16"],
    "fabric": [False, True],
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
            "kubernetes_pool_marks_rule", "kubernetes_user_data_limit", "disk_encryption", "fabric_row_problem",
            "fabric_fixed_count", "fabric_device_plugin"}


@pytest.mark.parametrize("cloud", clouds.NAMES)
def test_each_answer_is_one_the_next_part_reads(cloud: str) -> None:
    """The seams: the platform, fleet and price modules the profile names exist; its scheme,
    credential sources and metadata URL are ones the node-side code reads for this cloud."""
    p = clouds.profile(cloud)
    assert issubclass(clouds.platform_class(cloud), CloudPlatform)
    assert 0 <= p.fixed_instances(4, Market(type="spot"), False) <= 4
    assert p.fixed_instances(4, Market(type="on-demand"), False) == 0  # on-demand nodes scale in a group everywhere
    assert callable(refresh.refresher(cloud))
    assert p.storage_scheme in {*storage.ENDPOINTS, "s3"}
    assert {p.storage_credentials("vm"), p.storage_credentials("kubernetes")} <= set(CREDENTIAL_SOURCES)
    assert cloudmeta.cloud_metadata(cloud).METADATA_URL == p.metadata_url
    # a pod's own role: a source every cloud reads, or the one its node module exchanges a token for
    assert p.storage_credentials("kubernetes") in {"default", "instance-role", cloudmeta.cloud_node(cloud).POD_IDENTITY}
    assert p.fabric_placement("vm", Market(type="reserved")) and p.fabric in ("efa", "erdma", "hcc")
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
    hand_edited = packdata.render().replace("instancePasswords: false", "instancePasswords: 'false'", 1)
    with pytest.raises(ValueError, match="instancePasswords is 'false', not true or false"):
        pack_clouds.load(hand_edited)


# -- the node side: each cloud's metadata.py and node.py, through one loader ----------------------
PARTS = ("metadata", "node")


def _interface(protocol: str) -> set[str]:
    """The members of a node-side interface, as training/cloudmeta.py writes it down (typing-only
    there: the user data carries no typing code, so it is read from the source)."""
    tree = ast.parse((ROOT / "training" / "cloudmeta.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == protocol]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} | {
        n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("cloud", clouds.NAMES)
def test_every_clouds_node_modules_answer_the_whole_interface(cloud: str) -> None:
    """No silent fallback on the node either: each module defines every member of its interface."""
    assert cloudmeta.known_clouds("metadata") == cloudmeta.known_clouds("node") == sorted(clouds.NAMES)
    for part, protocol, module in (("metadata", "CloudMetadata", cloudmeta.cloud_metadata(cloud)),
                                   ("node", "CloudNode", cloudmeta.cloud_node(cloud))):
        wanted = _interface(protocol)
        assert len(wanted) >= 5 and "NAME" in wanted, protocol
        missing = sorted(m for m in wanted if not hasattr(module, m))
        assert missing == [], f"infra/clouds/{cloud}/{part}.py lacks {missing}"
        assert module.NAME == cloud
        for member in wanted:
            value = getattr(module, member)
            assert callable(value) or value is None or isinstance(value, str), f"{cloud}.{part}.{member}"


def test_mypy_checks_each_module_against_its_interface() -> None:
    """The modules as the type checker sees them (module-as-protocol): `make typecheck` fails when a
    signature drifts from training/cloudmeta.py's CloudMetadata / CloudNode."""
    from infra.clouds.alicloud import metadata as ali_metadata, node as ali_node
    from infra.clouds.aws import metadata as aws_metadata, node as aws_node
    from infra.clouds.tencentcloud import metadata as tc_metadata, node as tc_node

    answers: list[CloudMetadata] = [aws_metadata, ali_metadata, tc_metadata]
    tools: list[CloudNode] = [aws_node, ali_node, tc_node]
    assert len(answers) == len(tools) == len(clouds.NAMES)


@pytest.mark.parametrize("name", ["", "gcp", "AWS", "../x", "aws/../x", "aws/../../infra/clouds/aws", "/etc/passwd",
                                  "aws\x00", "aws.node", " aws"])
def test_the_loader_refuses_an_unknown_or_hostile_cloud_name(name: str) -> None:
    for load in (cloudmeta.cloud_metadata, cloudmeta.cloud_node):
        with pytest.raises(cloudmeta.UnknownCloud, match=r"is not a cloud known here \(known: alicloud, aws, tencentcloud;"):
            load(name)
    with pytest.raises(cloudmeta.MetadataError, match="GTS_CLOUD.*not a cloud known here"):
        from training.credentials import credential_source
        credential_source("instance-role", {"GTS_CLOUD": name})


def test_the_node_modules_are_standard_library_only_and_import_nothing_of_the_project() -> None:
    """They ship to nodes alone (user data, bundle): their one project name, cloudmeta, is handed
    in by the loader and imported for the type checker only."""
    for cloud in clouds.NAMES:
        for part in PARTS:
            tree = ast.parse((ROOT / "infra" / "clouds" / cloud / f"{part}.py").read_text(encoding="utf-8"))
            typing_only = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
            runtime = [n for n in tree.body if n not in typing_only]
            imported = {a.name.split(".")[0] for top in runtime for n in ast.walk(top) if isinstance(n, ast.Import)
                        for a in n.names} | {n.module.split(".")[0] for top in runtime for n in ast.walk(top)
                                             if isinstance(n, ast.ImportFrom) and n.module}
            assert imported <= set(sys.stdlib_module_names) | {"__future__"}, (cloud, part, imported)
            assert [ast.unparse(n) for t in typing_only for n in t.body] == ["from training import cloudmeta"]


def test_the_loader_imports_neither_infra_nor_pulumi() -> None:
    """In a checkout and the trainer image the modules are read by path from infra/clouds/<cloud>/:
    infra/'s packages (and so pulumi) stay unimported."""
    code = ("import sys; sys.path.insert(0, 'training'); import cloudmeta\n"
            "for c in cloudmeta.known_clouds(): cloudmeta.cloud_metadata(c); cloudmeta.cloud_node(c)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('infra', 'pulumi')), cloudmeta.known_clouds())")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] ['alicloud', 'aws', 'tencentcloud']"


def test_on_a_node_the_loader_reads_its_own_folder_and_nothing_else(tmp_path: Path) -> None:
    """A node's /usr/local/lib/gts holds cloudmeta.py and clouds/<its cloud>/: another cloud is
    unknown there, even where the folder the repository layout would name (../infra/clouds)
    holds one; a loaded module is handed the cloudmeta that loaded it (one MetadataError class)."""
    lib = tmp_path / "usr" / "local" / "lib" / "gts"
    (lib / "clouds" / "aws").mkdir(parents=True)
    shutil.copy(ROOT / "training" / "cloudmeta.py", lib / "cloudmeta.py")
    shutil.copy(ROOT / "infra" / "clouds" / "aws" / "metadata.py", lib / "clouds" / "aws" / "metadata.py")
    planted = tmp_path / "usr" / "local" / "lib" / "infra" / "clouds" / "alicloud"
    planted.mkdir(parents=True)
    (planted / "metadata.py").write_text("raise SystemExit('planted module ran')\n", encoding="utf-8")
    driver = tmp_path / "driver.py"
    driver.write_text(f"import sys\nsys.path.insert(0, {str(lib)!r})\nimport cloudmeta\n"
                      "print(cloudmeta.known_clouds(), cloudmeta.cloud_metadata('aws').cloudmeta is cloudmeta)\n"
                      "try:\n    cloudmeta.cloud_metadata('alicloud')\nexcept cloudmeta.UnknownCloud as exc:\n"
                      "    print(exc)\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-I", str(driver)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "['aws'] True"
    assert "'alicloud' is not a cloud known here (known: aws;" in out.stdout
    script = subprocess.run([sys.executable, "-I", str(lib / "cloudmeta.py"), "credentials", "--cloud", "alicloud"],
                            capture_output=True, text=True, timeout=60)  # the fetcher as the node runs it
    assert script.returncode == 2 and "invalid choice: 'alicloud' (choose from aws)" in script.stderr.replace("'aws'", "aws")
    assert "planted" not in out.stdout + out.stderr + script.stdout + script.stderr


def test_in_the_image_layout_the_trainer_finds_every_clouds_node_modules(tmp_path: Path) -> None:
    """The image holds what infra/image.py hashes (and the .dockerignore lets through) under
    /opt/gts: laid out alone, the trainer's credential code there finds each cloud's modules,
    and nothing of infra/ beyond them is needed."""
    opt = tmp_path / "opt" / "gts"
    for path in image._inputs(ROOT):
        dest = opt / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
    assert not (opt / "infra" / "__init__.py").exists() and not (opt / "infra" / "clouds" / "aws" / "profile.py").exists()
    code = ("import sys; from training import cloudmeta, credentials\n"
            "print(cloudmeta.known_clouds(), [cloudmeta.cloud_node(c).NAME for c in cloudmeta.known_clouds()],"
            " callable(credentials.credential_source('instance-role', {'GTS_CLOUD': 'tencentcloud'})),"
            " sorted(m for m in sys.modules if m.split('.')[0] in ('infra', 'pulumi')))\n")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(opt)!r}); " + code],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['alicloud', 'aws', 'tencentcloud'] ['alicloud', 'aws', 'tencentcloud'] True []"


def test_the_image_carries_what_its_hash_reads() -> None:
    """training/Dockerfile.dockerignore lets through what infra/image.py SOURCES hashes (the trainer
    and each cloud's node-side modules): the content tag changes whenever the image would."""
    ignore = (ROOT / "training" / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    assert [line[1:].rstrip("/") for line in ignore if line.startswith("!")] == list(image.SOURCES)
    hashed = {p.relative_to(ROOT).as_posix() for p in image._inputs(ROOT)}
    assert {f"infra/clouds/{c}/{part}.py" for c in clouds.NAMES for part in PARTS} <= hashed
    assert "training/cloudmeta.py" in hashed and not any(p.startswith("infra/clouds/aws/profile") for p in hashed)
