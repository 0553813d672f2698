"""The node agents' settings table (infra/data/node_settings.yaml) against the node itself: every
GTS_* variable a file the node runs reads (the node bundle's scripts and units, the user data's
fetcher and pool script) has its row, naming exactly the files that read it and the default
their code takes; every row is read, or is one of the settings node.env records for a reader;
what node.env renders and what the Kubernetes Job's GPU gate sets are the rows' `setBy`.

A read is an expansion in shell or a unit (`$GTS_X`, `${GTS_X:-…}`, systemd's `$$GTS_X`), or the
name as a whole string in Python (`os.environ.get("GTS_X")`, `env["GTS_X"]`, `REF = "GTS_X"`):
comments, docstrings, messages and unit descriptions that mention a name are not reads."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from infra import userdata
from infra.clouds import NAMES as CLOUDS
from infra.render import bundle, node_settings
from infra.resolve.groups import resolve
from infra.stack.stackfile import load_stack_spec
from tests.harness import ROOT
from tests.shell_code import shell_code, unit_code
from training import contract

NAME = re.compile(r"GTS_[A-Z0-9_]+")
SHELL_READ = re.compile(r"\$\$?\{?[#!]?(GTS_[A-Z0-9_]+)")
SHELL_DEFAULT = re.compile(r"\$\$?\{(GTS_[A-Z0-9_]+):?-([^}$]*)\}")
CODE = (".sh", ".py", ".service", ".sh.j2")  # node.env.j2 sets, the others read
# Rendered into node.env for a reader, read by no node agent. Dropping them would change every
# group's user data; a new entry here means a new setting nothing reads, so it is a choice.
RENDERED_UNREAD = {"GTS_ENV", "GTS_SCRATCH_GB"}


def node_files() -> list[str]:
    """Every file a node runs that can read a setting: the bundle's, the user data's (each
    cloud's metadata module) and the pool nodes' user-data script."""
    sources = {s for _, _, s in bundle.FILES} | {s for c in CLOUDS for _, _, s in userdata.files_of(c)}
    return sorted(s for s in sources | {"cloudinit/node.sh.j2"} if s.endswith(CODE))


def reads(path: str, text: str) -> dict[str, set[str]]:
    """name -> the literal defaults its reads in this file give it (empty: none given)."""
    found: dict[str, set[str]] = {}
    if path.endswith(".py"):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                found.setdefault(node.value, set())
            if (isinstance(node, ast.Call) and len(node.args) == 2
                    and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
                    and NAME.fullmatch(node.args[0].value)):  # type: ignore[attr-defined]
                found.setdefault(node.args[0].value, set()).add(node.args[1].value)  # type: ignore[attr-defined]
        return found
    code = unit_code(text) if path.endswith(".service") else shell_code(text)
    for name in SHELL_READ.findall(code):
        found.setdefault(name, set())
    for name, default in SHELL_DEFAULT.findall(code):
        found[name].add(default)
    return found


def read_on_nodes() -> dict[str, dict[str, set[str]]]:
    """name -> file -> the literal defaults it gives there, over every node file."""
    out: dict[str, dict[str, set[str]]] = {}
    for path in node_files():
        for name, defaults in reads(path, (ROOT / path).read_text(encoding="utf-8")).items():
            out.setdefault(name, {})[path] = defaults
    return out


def test_the_scan_covers_every_kind_of_node_file() -> None:
    files = node_files()
    for kind in CODE:
        assert any(f.endswith(kind) for f in files), f"no {kind} file among the node's: {files}"
    assert "cloudinit/units/gts-trainer.service" in files and "training/cloudmeta.py" in files


def test_a_read_is_code_not_a_comment_a_message_or_a_description() -> None:
    shell = ('# ${GTS_A:-x} in a comment\necho "# $GTS_B" # $GTS_C\nn=${#GTS_D} x=${GTS_E:-/e}\n'
             "s#a#${GTS_F}#g\n: \"${GTS_G:?}\"\nbash -c 'a \\\n  # $GTS_H' # \\\"$GTS_I\necho \\' # $GTS_J\n")
    assert reads("x.sh", shell) == {"GTS_B": set(), "GTS_D": set(), "GTS_E": {"/e"}, "GTS_F": set(), "GTS_G": set(),
                                    "GTS_H": set()}
    unit = ("[Unit]\nDescription=at GTS_A\n# $GTS_B\n[Service]\nExecStart=/bin/sh -c 'x $GTS_C "
            "$${GTS_D:+y} $$GTS_E'\n")
    assert reads("x.service", unit) == {"GTS_C": set(), "GTS_D": set(), "GTS_E": set()}
    python = ('"""GTS_A is read here."""\nimport os\n# os.environ["GTS_B"]\nREF = "GTS_C"\n'
              'x = os.environ.get("GTS_D", "/d")\nprint("--x (GTS_E) is required")\ny = env("GTS_F") or "f"\n')
    assert reads("x.py", python) == {"GTS_C": set(), "GTS_D": {"/d"}, "GTS_F": set()}


def test_every_setting_read_on_a_node_is_in_the_table_with_its_readers() -> None:
    found, table = read_on_nodes(), node_settings.by_name()
    assert len(found) > 20 and len(table) > 20, (len(found), len(table))
    missing = sorted(set(found) - set(table))
    assert not missing, f"read on a node, no row in infra/data/node_settings.yaml: {missing}"
    unread = sorted(n for n in set(table) - set(found) if table[n].read_by or n not in RENDERED_UNREAD)
    assert not unread, f"rows nothing on a node reads (remove them): {unread}"
    assert {n for n, s in table.items() if not s.read_by} == RENDERED_UNREAD
    wrong = {n: sorted(found[n]) for n in found if sorted(table[n].read_by) != sorted(found[n])}
    assert not wrong, f"readBy differs from the files that read it (name: the readers): {wrong}"


def test_each_default_in_the_code_is_the_tables() -> None:
    table, checked = node_settings.by_name(), 0
    for name, files in read_on_nodes().items():
        if name not in table:
            continue  # the test above names it
        for path, defaults in files.items():
            for default in defaults:
                checked += 1
                assert default == table[name].default, f"{path} defaults {name} to {default!r}, the table to " \
                                                       f"{table[name].default!r}"
    assert checked > 20, checked


def _contexts() -> list[userdata.NodeContext]:
    """Every group's node.env context of the shipped stacks, and each once more with what only
    some nodes get: NVLinks, a diag level, fixed instances, a store's address and a key's place."""
    out = []
    for stack in ("dev", "prod"):
        spec = resolve(load_stack_spec(stack))
        for group in spec.groups:
            ctx = userdata.node_context(spec.spec, group, userdata.IMAGE_PLACEHOLDER)
            out += [ctx, dataclasses.replace(ctx, nvlinks=12, gpu_diag_level=2, replace="none", trainer={
                **ctx.trainer, userdata.STORE_HOST: "10.0.0.9", userdata.RDZV_KEY_REF: "ref"})]
    return out


def test_what_node_env_renders_is_set_by_the_stack() -> None:
    rendered = {m for ctx in _contexts() for m in re.findall(r"^(GTS_[A-Z0-9_]+)=", userdata.render_env(ctx), re.M)}
    assert len(rendered) > 20, sorted(rendered)
    stack = {s.name for s in node_settings.load() if "stack" in s.set_by}
    trainer = contract.NAMES | contract.FABRIC_NAMES
    unknown = sorted(rendered - stack - trainer)
    assert not unknown, f"node.env renders them, no row says setBy: stack: {unknown}"
    assert not stack - rendered, f"rows say setBy: stack, node.env never renders them: {sorted(stack - rendered)}"


def test_what_the_jobs_gpu_gate_sets_is_set_by_job() -> None:
    from infra.k8s.job import gate_env  # the Job's own module (Pulumi's Kubernetes SDK) only here

    spec = resolve(load_stack_spec("prod"))
    pools = [g for g in spec.groups if g.kind == "kubernetes"]
    assert pools, "prod has no Kubernetes group"
    names = {n for g in pools for n in gate_env(g) if n.startswith("GTS_")}
    job = {s.name for s in node_settings.load() if "job" in s.set_by}
    assert names == job, f"the Job's gate sets {sorted(names - job)} (no setBy: job), not {sorted(job - names)}"


def test_a_setting_the_tests_set_is_set_in_the_tests() -> None:
    here = Path(__file__).name
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in (ROOT / "tests").rglob("*")
                     if p.is_file() and p.name != here and "golden" not in p.parts and p.suffix != ".pyc")
    claimed = [s.name for s in node_settings.load() if "tests" in s.set_by]
    assert claimed
    unset = [n for n in claimed if not re.search(rf"\b{n}\b", text)]
    assert not unset, f"setBy: tests, and no test names them: {unset}"


@pytest.mark.parametrize("name,entry,problem", [
    ("GTS_X", {"readBy": [], "setBy": ["stack"], "meaning": "m", "colour": "x"}, "colour"),
    ("GTS_X", {"readBy": [], "setBy": ["someone"], "meaning": "m"}, "setBy"),
    ("GTS_X", {"readBy": [], "setBy": [], "meaning": ""}, "meaning"),
    ("gts_x", {"readBy": [], "setBy": [], "meaning": "m"}, "name"),
    ("GTS_X", ["a list"], "not a mapping"),
])
def test_an_entry_out_of_shape_is_refused_naming_it(name: str, entry: object, problem: str) -> None:
    assert node_settings.parse({"settings": {"GTS_OK": {"readBy": [], "setBy": [], "meaning": "m"}}})
    with pytest.raises(node_settings.NodeSettingsError, match=rf"(?s)settings\.{name}: .*{problem}"):
        node_settings.parse({"settings": {"GTS_OK": {"readBy": [], "setBy": [], "meaning": "m"}, name: entry}})
