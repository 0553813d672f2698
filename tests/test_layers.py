"""infra/ by layer (issue #45): the folders are the layers, and a module imports only its own layer
and lower ones — every import counted, at module level, under `if TYPE_CHECKING:` and inside
functions. infra/ holds no loose module but the pinned ones (tools/relayer.py PINNED: their path
is written in bytes that reach a plan), and the relayer that made the move can make it again.

Bottom to top: core (errors, catalog, YAML), the cloud profiles (plain data), model (the spec),
resolve (the resolved stack), checks (the check phase), render (user data, bundle, image,
monitoring; infra/k8s beside it), the clouds' resource modules, stack (stackfile, program), and
the CLIs (infra/cli, plan, the teams and capacity commands, the price refresh)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness import ROOT
from tests.test_structure import _imports, _module_name


def _relayer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("relayer", ROOT / "tools" / "relayer.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("relayer", module)
    spec.loader.exec_module(module)
    return module


RELAYER = _relayer()
ORDER = ("core", "profiles", "model", "resolve", "checks", "render", "clouds", "stack", "cli")
# The packages that hold one concern across layers, module by module (the rest of each: `*`).
FEATURES: dict[str, dict[str, str]] = {
    # One cloud's knowledge in one place: its profile is plain data the spec asks (bottom), its
    # resources build on everything (top); the mock engine's answers belong to the plan.
    "clouds": {"": "profiles", "profile": "profiles", "*.profile": "profiles", "*.metadata": "profiles",
               "*.node": "profiles", "*.mocks": "cli", "*": "clouds"},
    "capacity": {"stock": "model", "reservations": "model", "transfer": "model", "workspace": "model",
                 "places": "resolve", "pricing": "resolve", "checks": "checks", "*": "cli"},
    "teams": {"registry": "model", "queues": "resolve", "generate": "checks", "*": "cli"},
    "prices": {"sources": "core", "age": "resolve", "*": "cli"},
    "k8s": {"*": "render"},
    "plan": {"*": "cli"},
    "cli": {"*": "cli"},
}
# (importer, imported) -> why an upward import is right; none today.
ALLOWED: dict[tuple[str, str], str] = {}


def layer_of(name: str) -> str:
    """The layer of a module of infra/, by its folder (a loose module: the relayer's map)."""
    parts = name.split(".")[1:]
    if not parts:
        return "core"
    if parts[0] in RELAYER.LAYERS:
        return str(parts[0])
    if len(parts) == 1 and parts[0] in RELAYER.MODULE_LAYER:
        return str(RELAYER.MODULE_LAYER[parts[0]])
    table = FEATURES[parts[0]]  # a new folder of infra/ needs its layer here
    rest = ".".join(parts[1:])
    tail = f"*.{parts[-1]}" if len(parts) > 2 else None
    return table.get(rest) or (tail and table.get(tail)) or table["*"]


def _files() -> dict[str, Path]:
    return {_module_name(p): p for p in (ROOT / "infra").rglob("*.py") if "__pycache__" not in p.parts}


def graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of infra/ modules; a package face that imports nothing is only its
    folder and carries no dependency."""
    found = {name: {m for m in _imports(path, name) if m in files and m != name} for name, path in files.items()}
    empty = {n for n, p in files.items() if p.name == "__init__.py" and not found[n]}
    return {name: deps - empty for name, deps in found.items()}


def upward(imports: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(ORDER)}
    return [f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a in sorted(imports) for b in sorted(imports[a])
            if rank[layer_of(b)] > rank[layer_of(a)] and (a, b) not in ALLOWED]


def test_every_import_goes_down_the_layers() -> None:
    imports = graph(_files())
    assert len(imports) > 100 and "infra.resolve.groups" in imports["infra.stack.program"]
    assert upward(imports) == []
    stale = [pair for pair in ALLOWED if pair[1] not in imports.get(pair[0], set())]
    assert stale == [], f"allowed upward imports that no longer exist: {stale}"


def test_the_check_catches_a_planted_upward_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from infra.checks import validation\n"
                       "def f() -> None:\n    from infra.stack.program import main\n", encoding="utf-8")
    files = {**_files(), "infra.model.planted": planted}
    found = [f for f in upward(graph(files)) if f.startswith("infra.model.planted ")]
    assert found == ["infra.model.planted (model) imports infra.checks.validation (checks)",
                     "infra.model.planted (model) imports infra.stack.program (stack)"]
    ALLOWED[("infra.model.planted", "infra.checks.validation")] = "a test"
    try:
        assert len([f for f in upward(graph(files)) if f.startswith("infra.model.planted ")]) == 1
    finally:
        del ALLOWED[("infra.model.planted", "infra.checks.validation")]


def test_every_module_has_a_layer() -> None:
    assert {layer_of(name) for name in _files()} == set(ORDER)
    assert set(RELAYER.ORDER) <= set(ORDER)
    folders = {p.name for p in (ROOT / "infra").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(RELAYER.LAYERS) | set(FEATURES), "a new folder of infra/ needs its layer (FEATURES)"


def test_infra_root_holds_only_pinned_modules_each_still_named_where_a_plan_reads() -> None:
    root = sorted(p.stem for p in (ROOT / "infra").glob("*.py"))
    loose = [m for m in root if m != "__init__"]
    assert "__init__" in root and set(loose) <= set(RELAYER.PINNED), "run tools/relayer.py (or give the module a layer there)"
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in ROOT.glob("**/*")
             if p.is_file() and RELAYER.plan_bytes(p.relative_to(ROOT).as_posix())
             and "__pycache__" not in p.parts]
    unneeded = [m for m in loose if not any(f"infra/{m}.py" in t or f"infra.{m}" in t for t in texts)]
    assert unneeded == [], f"no plan-reaching file names these any more: unpin them and run tools/relayer.py: {unneeded}"


def test_plan_bytes_covers_the_image_and_the_bundle() -> None:
    from infra import image
    from infra.render import bundle
    sources = [p.relative_to(ROOT).as_posix() for p in image._inputs(ROOT)] + [src for _, _, src in bundle.FILES]
    assert sources and [s for s in sources if not RELAYER.plan_bytes(s)] == []


def test_the_relayer_rewrites_every_form_once() -> None:
    # Names no module has, so that the relayer's own run over this file leaves it as it is.
    moves = {"alpha": "model", "beta": "core"}
    text = ('"""See infra/alpha.py and `python -m infra.alpha`."""\n'
            "from infra import clouds, beta as b, alpha\n"
            "from infra.alpha import Spec\n"
            'PATCH = "infra.alpha.Spec"\nHOME = ROOT / "infra" / "alpha.py"\n'
            'OTHER = "infra.alpha_two infra/cli/alpha.py"\n')
    once = RELAYER.rewrite(text, "tests/x.py", moves)
    assert once == ('"""See infra/model/alpha.py and `python -m infra.model.alpha`."""\n'
                    "from infra import clouds\nfrom infra.core import beta as b\nfrom infra.model import alpha\n"
                    "from infra.model.alpha import Spec\n"
                    'PATCH = "infra.model.alpha.Spec"\nHOME = ROOT / "infra" / "model" / "alpha.py"\n'
                    'OTHER = "infra.alpha_two infra/cli/alpha.py"\n')
    assert RELAYER.rewrite(once, "tests/x.py", moves) == once
    with pytest.raises(RELAYER.Refused, match="a relative import in infra/"):  # a move would repoint it silently
        RELAYER.rewrite("from .clouds import profile\n", "infra/alpha.py", moves)
    assert RELAYER.deepen('R = Path(__file__).resolve().parents[1]\nD = Path(__file__).parent / "d"\n', "x.py") == (
        'R = Path(__file__).resolve().parents[2]\nD = Path(__file__).parents[1] / "d"\n')


def test_the_relayer_refuses_a_module_it_has_no_layer_for(tmp_path: Path) -> None:
    (tmp_path / "infra").mkdir()
    for name in ("__init__", "spec", "brand_new"):
        (tmp_path / "infra" / f"{name}.py").write_text("", encoding="utf-8")
    with pytest.raises(RELAYER.Refused, match="infra/brand_new.py"):
        RELAYER.moves_for(tmp_path, move_pinned=False)
    (tmp_path / "infra" / "brand_new.py").unlink()
    assert RELAYER.moves_for(tmp_path, move_pinned=False) == {"spec": "model"}


def _sources() -> list[str]:
    """The repository's own files (what `git ls-files` lists, without starting git)."""
    tops = ("infra", "tests", "policies", "training", "examples", "docs", "tools", "cloudinit", ".github")
    found = [p for top in tops for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    found += [p for p in (*ROOT.glob("*"), *(ROOT / ".ci").glob("*")) if p.is_file()]
    return sorted(p.relative_to(ROOT).as_posix() for p in found)


def test_nothing_names_a_moved_module_by_its_old_name() -> None:
    """What a later change wrote with an old name (`from infra import spec`) is the relayer's to fix."""
    names = RELAYER.rewritten_names(ROOT, {})
    assert len(names) > 30
    edits = RELAYER.edits_for(ROOT, _sources(), names, move_pinned=False)
    assert sorted(edits) == [], "run tools/relayer.py"


def test_no_text_imports_a_moved_module_from_the_infra_root() -> None:
    """`from infra import spares` in a string a test runs (a subprocess's code), a doc or a script
    is not an import the relayer's syntax-tree rewrite sees; a line of it still names the old place."""
    moved = set(RELAYER.rewritten_names(ROOT, {}))
    assert len(moved) > 30
    pattern = re.compile(r"\bfrom infra import \(?([\w, ]+)")
    found = []
    for rel in _sources():
        if rel in ("tools/relayer.py", "tests/test_layers.py") or not rel.endswith((".py", ".md", ".sh", ".j2", ".yaml")):
            continue
        for n, line in enumerate((ROOT / rel).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in pattern.finditer(line):
                names = {part.strip().split(" as ")[0] for part in m.group(1).split(",")}
                if names & moved:
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert found == [], "names a moved module at the infra/ root:\n" + "\n".join(found)
