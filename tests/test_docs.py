"""The docs a newcomer reads: the generated spec reference is current, every command in a fenced
sh/bash block is run by a test or CI (a make target, or an allow-listed command naming the test
that runs it) or sits in a block marked as not runnable here, and every link between the README
and docs/ resolves."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from infra.cli import docs as gen
from infra.model import spec as specmod
from tests.harness import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [ROOT / "README.md", *PAGES]
# Written in another branch (the new-cloud checklist); the README and clouds.md link it already.
# Tolerated only while it is absent: once merged, its links are checked like any other.
PENDING = {ROOT / "docs" / "adding-a-cloud.md"}
MARKER = re.compile(r"^\s*<!-- not run here: \S.* -->\s*$")
# Programs that need a cloud account, a cluster or the Pulumi CLI: only in a marked block.
NEEDS_CLOUD = re.compile(r"^(pulumi|kubectl|aws|aliyun|tccli|python -m infra\.teams (preview|up|destroy|refresh))\b")
# Commands that are not make targets, each with the test that runs it and a string that test's
# file must hold (evidence that it runs this command, so a renamed test fails here).
ALLOWED: dict[str, tuple[str, str]] = {
    r"kill -(TERM|USR1) <pid>$": ("tests/test_training.py::test_a_stopped_run_exits_zero_through_the_entrypoint_and_resumes",
                                  "SIGUSR1"),
    r"python - <<'PY'$": ("tests/test_checkpoints.py::test_a_damaged_newest_step_falls_back_to_the_previous_one",
                          "_flip_a_byte"),
    r"python -m infra\.capacity watch ": ("tests/test_capacity_broker.py::test_the_command_refuses_bad_input_in_one_line",
                                         '"infra.capacity"'),
    r"python -m training\.goodput ": ("tests/test_goodput.py::test_the_command_prints_the_interval_and_simulates_a_file",
                                      '"training.goodput"'),
    r"python -m training\.node\.rdzv_store ": ("tests/test_elastic.py::test_three_nodes_lose_one_go_on_and_take_it_back",
                                         "elastic_cluster()"),
    r"export RDZV_KEY=": ("tests/test_elastic.py::test_three_nodes_lose_one_go_on_and_take_it_back", "elastic_node"),
    r"bash training/node/entrypoint\.sh ": ("tests/test_elastic.py::test_three_nodes_lose_one_go_on_and_take_it_back",
                                       "elastic_node"),
    r"torchrun --standalone --nproc-per-node \d -m training\.trainer\.train --workload gpt-tiny --sharding fsdp$": (
        "tests/test_sharded.py::test_stopped_and_resumed_equals_uninterrupted_and_a_bad_shard_means_the_previous_step",
        '"gpt-tiny", "--sharding", "fsdp"'),
    r"torchrun --standalone --nproc-per-node \d examples/fsdp_loop\.py ": (
        "tests/test_sharded.py::test_a_users_fsdp_checkpoint_of_two_ranks_resumes_on_fewer_or_more", "fsdp_loop.py"),
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    marked: bool
    commands: tuple[str, ...]


def _commands(body: list[str]) -> list[str]:
    """The commands of a block: comments dropped, `\\` continuations joined, heredoc bodies
    skipped, a `for …; do` loop read as the command it runs, leading NAME=value assignments and
    background `&` dropped, `a; b` split."""
    out: list[str] = []
    joined: list[str] = []
    lines = iter(body)
    for raw in lines:
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if joined:
            line = joined.pop() + " " + line.strip()
        if line.endswith("\\"):
            joined.append(line[:-1].rstrip())
            continue
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            for rest in lines:
                if rest.strip() == heredoc.group(1):
                    break
        for part in _split(line.strip()):
            part = re.sub(r"^(for \w+ in [^;]*|do|done)$", "", part.strip())
            part = re.sub(r"^do\s+", "", part)
            while re.match(r"^[A-Z_][A-Z0-9_]*=\S*\s", part):
                part = part.split(None, 1)[1]
            if part and part != "done":
                out.append(part)
    return out


def _split(line: str) -> list[str]:
    """`a; b & c` -> [a, b, c], leaving `;` and `&` inside quotes and `$(...)` alone."""
    parts, current, quote, depth = [], "", "", 0
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif line.startswith("$(", i):
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif ch in ";&" and not depth and not line.startswith("&&", i) and not line.startswith("&", i - 1):
            parts.append(current)
            current = ""
            continue
        current += ch
    return [p.strip() for p in [*parts, current]]


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^\s*(`{3,})(\S*)", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1))
            if fence.group(2) in ("sh", "bash"):
                body = [line.strip() for line in lines[i + 1:end]]
                found.append(Block(path, i + 1, bool(i and MARKER.match(lines[i - 1])), tuple(_commands(body))))
            i = end + 1
    return found


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([a-z][a-z0-9-]*):(?!=)", text, flags=re.M))


def test_the_spec_reference_and_pulumi_yaml_are_generated_from_the_spec() -> None:
    """And docs/node-bootstrap.md's node settings table from infra/data/node_settings.yaml."""
    assert len(gen.outputs()) == 3
    for path, text in gen.outputs().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run `make docs`"


def test_a_stale_reference_is_caught(tmp_path: Path) -> None:
    """--check on a copy whose spec.md lost a row exits 1 and names the file; `make docs` mends it.
    The same for the node settings table in node-bootstrap.md."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "Pulumi.yaml").write_text((ROOT / "Pulumi.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    node_md = (ROOT / "docs" / "node-bootstrap.md").read_text(encoding="utf-8")
    (tmp_path / "docs" / "node-bootstrap.md").write_text(node_md, encoding="utf-8")
    stale = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8").replace("| `bucketPrefix` |", "| `bucketprefix` |")
    (tmp_path / "docs" / "spec.md").write_text(stale, encoding="utf-8")
    assert gen.main(["--check", "--root", str(tmp_path)]) == 1
    assert gen.main(["--root", str(tmp_path)]) == 0
    assert gen.main(["--check", "--root", str(tmp_path)]) == 0
    assert "| `GTS_MODE` |" in node_md
    (tmp_path / "docs" / "node-bootstrap.md").write_text(node_md.replace("| `GTS_MODE` |", "| `GTS_MOD` |"),
                                                          encoding="utf-8")
    assert gen.main(["--check", "--root", str(tmp_path)]) == 1
    assert gen.main(["--root", str(tmp_path)]) == 0
    assert gen.main(["--check", "--root", str(tmp_path)]) == 0


def test_every_spec_field_has_a_description_and_a_row() -> None:
    reference = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    for model, _ in gen.models():
        section = reference.split(f"### {model.__name__}\n", 1)[1].split("\n### ", 1)[0]
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no Field(description=...)"
            assert f"| `{field.alias or name}` |" in section, f"{model.__name__}.{field.alias} has no row"


def test_the_reference_names_allowed_values_and_defaults() -> None:
    reference = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    assert "| `checkpointEvery` | integer or `auto` | `500` | a whole number above 0, or `auto` |" in reference
    assert "| `launcher` | string | `torchrun` | one of `torchrun`, `accelerate`, `horovod` |" in reference
    assert "datasetUrl" not in reference  # the drifted hand-written key of the old Pulumi.yaml


def test_pulumi_yaml_stays_a_project_file_documenting_every_key() -> None:
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text(encoding="utf-8"))
    assert project["name"] == "gpu-training-stack" and project["runtime"]["name"] == "python"
    assert tuple(project["config"]) == specmod.CONFIG_KEYS
    for key, entry in project["config"].items():
        assert set(entry) <= {"type", "description"} and entry["description"], key
        assert entry.get("type", "string") in ("string", "boolean", "integer"), key  # never `object` (pulumi#11321)


def test_every_command_in_the_docs_is_a_make_target_or_run_by_a_named_test() -> None:
    targets, problems = make_targets(), []
    for block in blocks():
        for command in block.commands:
            where = f"{block.path.relative_to(ROOT)}:{block.line}: {command!r}"
            if NEEDS_CLOUD.match(command):
                if not block.marked:
                    problems.append(f"{where} cannot run here: mark its block <!-- not run here: why -->")
                continue
            if block.marked:
                problems.append(f"{where} runs here: move it out of the block marked not run here")
            elif command.startswith("make"):
                words = shlex.split(command)
                target = next((w for w in words[1:] if not w.startswith("-") and "=" not in w), "")
                if target and target not in targets:
                    problems.append(f"{where}: no target {target!r} in the Makefile")
            elif not any(re.match(pattern, command) for pattern in ALLOWED):
                problems.append(f"{where}: neither a make target nor in tests/test_docs.py ALLOWED (name the test)")
    assert not problems, "\n".join(problems)


def test_the_allow_list_names_tests_that_exist_and_run_the_command() -> None:
    for pattern, (test, evidence) in ALLOWED.items():
        file, name = test.split("::")
        text = (ROOT / file).read_text(encoding="utf-8")
        assert f"def {name}(" in text, f"{pattern}: {test} does not exist"
        assert evidence in text, f"{pattern}: {file} no longer holds {evidence!r}"
    used = [c for b in blocks() for c in b.commands]
    for pattern in ALLOWED:
        assert any(re.match(pattern, c) for c in used), f"ALLOWED {pattern!r} matches no command in the docs: drop it"


def test_the_command_reader_sees_through_loops_heredocs_and_markers() -> None:
    body = ["make plan   # a comment", "for n in 0 1; do A=1 B=2 \\", "  bash training/node/entrypoint.sh --x & done",
            "python - <<'PY'", "import os", "PY", "make test; kill -TERM <pid>"]
    assert _commands(body) == ["make plan", "bash training/node/entrypoint.sh --x", "python - <<'PY'", "make test",
                               "kill -TERM <pid>"]
    assert NEEDS_CLOUD.match("pulumi up --stack dev") and not NEEDS_CLOUD.match("python -m infra.plan")
    marked = [b for b in blocks() if b.marked]
    assert marked and all(any(NEEDS_CLOUD.match(c) for c in b.commands) for b in marked)


def _links(path: Path) -> list[str]:
    text = re.sub(r"(?s)```.*?```", "", path.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / link.split("#")[0]).resolve() for link in _links(ROOT / "README.md")}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"README.md does not link: {missing}"
    assert PENDING <= linked, "README.md should link the new-cloud checklist"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    bad = []
    for link in _links(path):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue
        target = (path.parent / link.split("#")[0]).resolve()
        if not target.exists() and target not in PENDING:
            bad.append(link)
    assert not bad, f"{path.relative_to(ROOT)}: links to nothing: {bad}"
