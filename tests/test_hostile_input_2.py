"""The stack file's YAML tried as a careless and a hostile user would (issue 48): merge keys work
and keys given twice are still refused, tags and dates are read as the Pulumi CLI reads them or
refused naming the key, aliases cannot multiply without bound, and values that YAML 1.1 or a
lax number type would read otherwise (`50:00`, `1_0`, `true`, `.inf`) are refused with the fix.
A seeded generator of hostile documents checks that the reader only ever answers with a
config or one line naming the file (tests/test_hostile_yaml_fuzz.py)."""

from __future__ import annotations

import json
from ipaddress import IPv4Network
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.core.errors import SpecError
from infra.stack.stackfile import StackFileError, read_stack_text
from infra.teams import registry
from tests.harness import parse_spec as parse
from tests.harness import ROOT, key, project_copy, spec_raw, stack_values
from tests.test_hostile_input import _plan
from tests.test_hostile_stackfile import _problems

PROJECT = "gpu-training-stack"


def _read(text: str) -> dict[str, Any]:
    values = read_stack_text(text, "Pulumi.x.yaml", PROJECT).values
    return {k: json.loads(v) for k, v in values.items()}


def _refused(text: str) -> str:
    with pytest.raises(StackFileError) as caught:
        read_stack_text(text, "Pulumi.x.yaml", PROJECT)
    message = str(caught.value)
    assert message.startswith("Pulumi.x.yaml") and "\n" not in message and "Traceback" not in message
    return message


# ------------------------------------------------------------------ merge keys and duplicates

BASE = "config:\n  gpu-training-stack:a: &base {x: 1, y: 2}\n  gpu-training-stack:c: &c {y: 5, z: 6}\n"


@pytest.mark.parametrize("merged,want", [
    ("  gpu-training-stack:b:\n    <<: *base\n    z: 3\n", {"x": 1, "y": 2, "z": 3}),
    # The merge-key type (yaml.org/type/merge.html): a merged key the mapping already has is not
    # inserted, so writing it again is an override, not a duplicate.
    ("  gpu-training-stack:b:\n    <<: *base\n    y: 3\n", {"x": 1, "y": 3}),
    ("  gpu-training-stack:b: {y: 3, <<: *base}\n", {"x": 1, "y": 3}),
    # A list of merged maps: the first one that has a key gives it.
    ("  gpu-training-stack:b: {<<: [*base, *c]}\n", {"x": 1, "y": 2, "z": 6}),
    ("  gpu-training-stack:b: {<<: [*c, *base]}\n", {"x": 1, "y": 5, "z": 6})])
def test_merge_keys_are_read_as_the_merge_key_type_says(merged: str, want: dict[str, Any]) -> None:
    assert _read(BASE + merged)[f"{PROJECT}:b"] == want


@pytest.mark.parametrize("text,line,where", [
    ("  gpu-training-stack:b:\n    <<: *base\n    y: 3\n    y: 4\n", 7, "'y'"),  # two written keys
    ("  gpu-training-stack:b:\n    <<: *base\n    <<: *c\n", 6, "'<<'"),  # two merge keys: write a list
    ("  gpu-training-stack:b: {x: 1, x: 1}\n", 4, "'x'")])  # equal values are still said twice
def test_keys_written_twice_are_still_refused(text: str, line: int, where: str) -> None:
    message = _refused(BASE + text)
    assert message.startswith(f"Pulumi.x.yaml, line {line}: key {where} is given twice; keep one")


def test_a_merge_key_needs_a_mapping() -> None:
    message = _refused(BASE + "  gpu-training-stack:b: {<<: 5}\n")
    assert "config.gpu-training-stack:b.<<: a merge key takes a mapping" in message


def test_a_stack_file_with_merge_keys_plans(tmp_path: Path) -> None:
    """The issue's regression end to end: a merged tag set plans as the written one does."""
    proj = project_copy(tmp_path)
    text = (ROOT / "Pulumi.dev.yaml").read_text()
    tags = stack_values("dev")[key("tags")]
    assert "gpu-training-stack:tags:\n" in text
    anchored = f"x-tags: &tags {json.dumps(tags)}\n" + text.replace(
        "gpu-training-stack:tags:\n", "gpu-training-stack:tags:\n    <<: *tags\n", 1)
    (proj / "Pulumi.merged.yaml").write_text(anchored)
    proc = _plan(proj, "merged", GTS_TODAY="2026-11-30")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["resources"]) > 10


def test_teams_yaml_takes_merge_keys_and_refuses_duplicates(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    (proj / "Pulumi.prod.yaml").write_text((ROOT / "Pulumi.prod.yaml").read_text())
    text = (proj / "teams.yaml").read_text()
    shared = "    markets: {spotOnly: true}\n    monthlyBudgetUsd: 60000\n"
    assert shared in text
    merged = text.replace(shared, "    markets: &spot {spotOnly: true}\n    monthlyBudgetUsd: 60000\n", 1)
    merged = merged.replace("    markets: {spotOnly: true}\n    monthlyBudgetUsd: 30000\n",
                            "    markets: {<<: *spot}\n    monthlyBudgetUsd: 30000\n", 1)
    assert merged.count("<<: *spot") == 1
    (proj / "teams.yaml").write_text(merged)
    assert registry.load(proj) == registry.load(ROOT)
    (proj / "teams.yaml").write_text(merged.replace("{<<: *spot}", "{<<: *spot, spotOnly: true, spotOnly: false}"))
    with pytest.raises(registry.RegistryError, match="key 'spotOnly' is given twice"):
        registry.load(proj)


# ------------------------------------------------------------------ tags and dates

def test_a_date_is_text_as_the_pulumi_cli_reads_it() -> None:
    """yaml.v3 hands an unquoted date to an untyped value as its text; so does this reader."""
    assert _read("config:\n  gpu-training-stack:tags: {owner: 2026-01-01}\n")[f"{PROJECT}:tags"] == {
        "owner": "2026-01-01"}


@pytest.mark.parametrize("value,tag", [
    ("!!binary aGVsbG8=", "!!binary"), ("!!set {a, b}", "!!set"), ("!!timestamp 2026-01-01", "!!timestamp"),
    ("!!omap [{a: 1}]", "!!omap"), ("!!python/object/apply:os.system [id]", "!!python/object/apply:os.system"),
    ("!custom x", "!custom")])
def test_other_tags_are_refused_naming_the_key(value: str, tag: str) -> None:
    message = _refused(f"config:\n  gpu-training-stack:tags:\n    owner: {value}\n")
    assert message.startswith(f"Pulumi.x.yaml, line 3: config.gpu-training-stack:tags.owner: the tag {tag} ")
    assert "remove the tag" in message and "keep one" not in message


@pytest.mark.parametrize("value", ["!!int abc", "!!bool maybe", "!!float x1"])
def test_a_core_tag_on_a_value_it_cannot_read_is_refused(value: str) -> None:
    message = _refused(f"config:\n  gpu-training-stack:steps: {value}\n")
    assert "config.gpu-training-stack:steps:" in message and "remove the tag" in message


def test_a_tagged_stack_file_stops_the_plan_with_its_key(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    text = (ROOT / "Pulumi.dev.yaml").read_text()
    owner = stack_values("dev")[key("tags")]["owner"]
    (proj / "Pulumi.tagged.yaml").write_text(text.replace(f"owner: {owner}", "owner: !!binary aGVsbG8=", 1))
    proc = _plan(proj, "tagged", GTS_TODAY="2026-11-30")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Pulumi.tagged.yaml, line" in proc.stderr and "tags.owner: the tag !!binary" in proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


# ------------------------------------------------------------------ bounded work

def _laughs(levels: int = 9) -> str:
    lines = ["config:", "  gpu-training-stack:l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  gpu-training-stack:l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _within(seconds: float, call: Any) -> Any:
    """`call()` in a thread; a hang detector only (the bound is generous, nothing is timed)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_billion_laughs_is_refused_at_the_expansion_bound() -> None:
    text = _laughs()
    assert len(text) < 2000  # the 1.7 KB file: a billion strings once expanded
    with pytest.raises(StackFileError, match=r"more than 100,000 values once aliases are expanded"):
        _within(120, lambda: read_stack_text(text, "Pulumi.x.yaml", PROJECT))
    assert _read(_laughs(3))[f"{PROJECT}:l3"][0][0][0] == ["lol"] * 10  # a few aliases are fine


@pytest.mark.parametrize("name,text,says", [
    ("laughs", _laughs(), "more than 100,000 values once aliases are expanded"),
    ("itself", "config:\n  gpu-training-stack:a: &a {b: *a}\n", "nested deeper than 64 levels"),
    ("deep", "config:\n  gpu-training-stack:a: " + "[" * 200_000 + "]" * 200_000 + "\n", "nests deeper than 64"),
    ("wide", "config:\n  gpu-training-stack:a: [" + "1," * 200_000 + "1]\n", "more than 100,000 values"),
    ("huge", "config:\n  gpu-training-stack:a: '" + "x" * (1 << 20) + "'\n", "larger than 1024 KiB")])
def test_a_stack_file_cannot_hang_or_crash_the_plan(tmp_path: Path, name: str, text: str, says: str) -> None:
    """What CI's `make diff` would meet in a pull request: exit 2 naming the file (the libyaml
    composer recurses in C: 200,000 brackets crashed the interpreter before the depth bound)."""
    proj = project_copy(tmp_path)
    (proj / f"Pulumi.{name}.yaml").write_text(text)
    proc = _plan(proj, name, GTS_TODAY="2026-11-30")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert f"Pulumi.{name}.yaml" in proc.stderr and says in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ numbers as the Pulumi CLI reads them

@pytest.mark.parametrize("written,read", [
    ("50:00", "50:00"), ("1_0", "1_0"), ("yes", "yes"), ("on", "on"), ("1.0e+400", "1.0e+400"),
    ("0o17", 15), ("017", 15), ("0x1F", 31), ("1e3", 1000.0), ("true", True), ("~", None), (".inf", float("inf"))])
def test_scalars_resolve_as_yaml_1_2_does(written: str, read: Any) -> None:
    assert _read(f"config:\n  gpu-training-stack:v: {{x: {written}}}\n")[f"{PROJECT}:v"]["x"] == read




def _group0(name: str, value: Any) -> Any:
    return lambda c: c[key("nodeGroups")][0]["market"].__setitem__(name, value)


def _section(section: str, name: str, value: Any) -> Any:
    return lambda c: c[key(section)].__setitem__(name, value)


def _net0(name: str, value: Any) -> Any:
    return lambda c: c[key("networks")][0].__setitem__(name, value)


VALUES = [
    ("budget.monthlyLimitUsd", _section("budget", "monthlyLimitUsd", float("inf")), "inf is not a finite number"),
    ("budget.monthlyLimitUsd", _section("budget", "monthlyLimitUsd", "1.0e+400"), "write a finite amount"),
    ("nodeGroups[0].market.spotMaxPriceUsd", _group0("spotMaxPriceUsd", True), "true is a YAML boolean, not a number"),
    ("nodeGroups[0].market.spotMaxPriceUsd", _group0("spotMaxPriceUsd", "5"), "'5' is text, not a number; write it "
                                                                               "unquoted (5)"),
    ("training.steps", _section("training", "steps", "50:00"), "has no base-60 numbers: write 3000"),
    ("storage.datasetTmpfsGb", _section("storage", "datasetTmpfsGb", "1_0"), "without underscores (10)"),
    ("training.checkpointEvery", lambda c: c[key("training")].update(steps=100, checkpointEvery=500),
     "500 is above training.steps (100)"),
    ("networks[0].cidr", _net0("cidr", "8.8.0.0/16"), "is not a private range for aws (10.0.0.0/8"),
    ("networks[1].cidr", lambda c: c[key("networks")][1].__setitem__("cidr", "100.64.0.0/16"),
     "100.64.0.0/16 is in 100.64.0.0/10, which alicloud does not take: Alibaba Cloud reserves it"),
    ("networks[2].cidr", lambda c: c[key("networks")][2].__setitem__("cidr", "100.64.0.0/16"),
     "which tencentcloud does not take: Tencent Cloud's CreateVpc takes only the RFC 1918 ranges"),
    ("networks[0].cidr", _net0("cidr", "10.0.0.0"), "'10.0.0.0': has no prefix length; write the network as a CIDR"),
    ("budget.alertEmails[0]", _section("budget", "alertEmails", ["$(touch PWNED)@example.com"]), "plain address"),
    ("budget.alertEmails[0]", _section("budget", "alertEmails", ["a;b@example.com"]), "plain address"),
    ("kubernetes.queues", _section("kubernetes", "queues", "../../etc/teams.yaml"), "relative to the project"),
    ("kubernetes.queues", _section("kubernetes", "queues", "/etc/teams.yaml"), "relative to the project")]


@pytest.mark.parametrize("where,edit,says", VALUES, ids=[f"{w}-{i}" for i, (w, _, _) in enumerate(VALUES)])
def test_values_that_cannot_work_are_refused_with_the_fix(where: str, edit: Any, says: str) -> None:
    problems = _problems(edit)
    assert any(p.startswith(f"{where}: ") and says in p for p in problems), problems


@pytest.mark.parametrize("cidr", ["100.64.0.0/16", "198.19.0.0/16"])
def test_aws_takes_the_ranges_its_vpc_guide_lists_beyond_rfc_1918(cidr: str) -> None:
    config = stack_values("dev")
    net = config[key("networks")][0]
    assert net["cloud"] == "aws"
    old = IPv4Network(net["cidr"])
    net["cidr"] = cidr
    for group in config[key("networks")][0].get("subnets", []):  # the subnets move with it
        group["cidr"] = str(IPv4Network(group["cidr"]).network_address - int(old.network_address)
                            + int(IPv4Network(cidr).network_address)) + "/" + group["cidr"].split("/")[1]
    assert not [p for p in _problems_or_none(config) if p.startswith("networks[0].cidr")]


def _problems_or_none(config: dict[str, Any]) -> list[str]:
    try:
        parse(spec_raw(config))
    except SpecError as exc:
        return [str(p) for p in exc.problems]
    return []


def test_a_cidr_without_its_prefix_is_named_not_its_subnets() -> None:
    """A CIDR without a prefix was the /32 of one address, and only its subnets were blamed."""
    problems = _problems(_net0("cidr", "10.0.0.0"))
    assert [p for p in problems if p.startswith("networks[0]")] == [
        "networks[0].cidr: '10.0.0.0': has no prefix length; write the network as a CIDR, e.g. 10.0.0.0/16"]


def test_teams_yaml_owners_are_plain_addresses(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    (proj / "Pulumi.prod.yaml").write_text((ROOT / "Pulumi.prod.yaml").read_text())
    text = (proj / "teams.yaml").read_text()
    (proj / "teams.yaml").write_text(text.replace("[vision-leads@example.com]", "['x$(id)@example.com']", 1))
    with pytest.raises(registry.RegistryError, match=r"teams\[0\]\.owners\[0\].*plain address"):
        registry.load(proj)


def test_the_registry_a_stack_queues_on_stays_in_the_project(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    outside = tmp_path / "outside.yaml"
    outside.write_text((ROOT / "teams.yaml").read_text())
    (proj / "elsewhere.yaml").symlink_to(outside)
    with pytest.raises(registry.RegistryError, match="leads out of the project"):
        registry.load(proj, "elsewhere.yaml")


def test_shipped_stacks_read_the_same_with_pyyaml_safe_load() -> None:
    """The reader changed for hostile files only: every shipped stack file and teams.yaml reads
    as PyYAML's safe_load reads it."""
    from infra.core import yamlread

    for path in [*sorted(ROOT.glob("Pulumi.*.yaml")), ROOT / "teams.yaml"]:
        text = path.read_text(encoding="utf-8")
        assert yamlread.load(text) == yaml.safe_load(text), path.name


def test_a_punycode_address_and_a_dot_slash_registry_are_taken() -> None:
    config = stack_values("prod")  # the stack that queues on teams.yaml
    config[key("budget")]["alertEmails"] = ["ml-team@example.xn--p1ai"]
    config[key("kubernetes")]["queues"] = "./teams.yaml"
    assert _problems_or_none(config) == []
    assert parse(spec_raw(config)).kubernetes.queues == "teams.yaml"
