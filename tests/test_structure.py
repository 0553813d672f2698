"""The house rules a newcomer can rely on: no import cycle between the project's modules (every
import counts: module level, typing-only under `if TYPE_CHECKING:`, and inside functions and
classes — a cycle hidden in a function is still a cycle), and no function so long that it cannot
be read top to bottom (60 lines, unless a `# long:` comment on the line above says why), nor a
source file past 400 lines — in the packages, the tests, the examples and the node scripts alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.harness import ROOT

PACKAGES = ("infra", "policies", "training")
LIMIT = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Project modules a module imports anywhere: module level, under `if TYPE_CHECKING:`, and
    inside functions and classes."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Import):
            found |= {a.name for a in sub.names}
        elif isinstance(sub, ast.ImportFrom):
            base = sub.module or ""
            if sub.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - sub.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in sub.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in packages for p in (ROOT / pkg).rglob("*.py")
             if "__pycache__" not in p.parts and p.name != "__main__.py" or p.parent.name == "plan"}
    return {name: {m for m in _imports(path, name) if m in files and m != name} for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_the_projects_modules() -> None:
    """infra/ and policies/ together (the stack program, the plan and the pack), every import counted."""
    graph = _graph(("infra", "policies"))
    assert len(graph) > 40 and "infra.resolve.groups" in graph["infra.stack.program"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_import_cycle_in_training() -> None:
    graph = _graph(("training",))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_typing_only_and_function_local_imports(tmp_path: Path) -> None:
    """The imports a module-level-only walk missed (how two cycles hid in infra/): each counts."""
    module = tmp_path / "mod.py"
    module.write_text("from __future__ import annotations\n"
                      "from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from infra.resolve.groups import Stack\n"
                      "def f() -> None:\n    from infra.model.spec import StackSpec\n"
                      "class C:\n    def g(self) -> None:\n        import infra.core.catalog\n"
                      "    from . import sibling\n", encoding="utf-8")
    found = _imports(module, "infra.mod")
    assert {"infra.resolve.groups", "infra.model.spec", "infra.core.catalog", "infra.sibling"} <= found
    # and a cycle through such imports alone is found
    graph = {"infra.mod": {"infra.resolve.groups"}, "infra.resolve.groups": {"infra.mod"}}
    cycle = _cycle(graph) or []
    assert len(cycle) == 3 and cycle[0] == cycle[-1] and set(cycle) == {"infra.resolve.groups", "infra.mod"}, cycle


# Every source file of the checkout: the packages, the tests, the examples, the node scripts.
SOURCE_DIRS = (*PACKAGES, "tests", "examples", "cloudinit")
FILE_LIMIT = 400


def _sources(suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    skip = {"__pycache__", "venv", ".venv", "node_modules"}  # caches and installed packages (policies/venv)
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in suffixes
                  and not skip & set(p.relative_to(ROOT).parts) and p.is_file()) + [ROOT / "__main__.py"]


def test_no_file_is_too_long_to_read() -> None:
    """No source file over 400 lines (issue 35): a file is read top to bottom too."""
    long = {str(p.relative_to(ROOT)): n for p in _sources((".py", ".sh"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > FILE_LIMIT}
    assert long == {}


def _long_functions() -> list[str]:
    out = []
    for path in _sources():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                reason = lines[node.lineno - 2].strip().startswith("# long:") if node.lineno > 1 else False
                if length > LIMIT and not reason:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_no_function_is_too_long_to_read() -> None:
    assert _long_functions() == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_walked(package: str) -> None:
    assert any(name.startswith(package + ".") for name in _graph())


# training/'s three audiences (training/__init__.py): the library at the top level, our reference
# trainer in training/trainer/, the node-side tools in training/node/. Imports point one way: the
# trainer and the node tools use the library, the node tools never use the trainer, the library
# uses neither. Every import counts here: module level, function-local and typing-only.
LAYERS = {"training.trainer": ("training.node",), "training.node": ("training.trainer",),
          "training": ("training.trainer", "training.node")}


def _layer(module: str) -> str:
    return next(p for p in ("training.trainer", "training.node", "training")
                if module == p or module.startswith(p + "."))


def _all_imports(path: Path, name: str) -> set[str]:
    """Every module a module names in an import statement, wherever the statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for sub in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(sub, ast.Import):
            found |= {a.name for a in sub.names}
        elif isinstance(sub, ast.ImportFrom):
            base = sub.module or ""
            if sub.level:
                parts = package.split(".")[:len(package.split(".")) - sub.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in sub.names}
    return found


def _layer_violations(imports: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for each import that points the wrong way between training/'s layers."""
    return sorted(f"{name} -> {m}" for name, found in imports.items() for m in found
                  if any(m == f or m.startswith(f + ".") for f in LAYERS[_layer(name)]))


def test_training_layers_point_one_way() -> None:
    imports = {_module_name(p): _all_imports(p, _module_name(p)) for p in (ROOT / "training").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert {"training.ckpt.checkpointer", "training.trainer.train", "training.node.datasync"} <= set(imports)
    assert "training.ckpt.manager" in imports["training.trainer.train"]  # the walk sees the imports
    assert _layer_violations(imports) == []


def test_the_layer_check_finds_a_wrong_way_import() -> None:
    ok = {"training.trainer.train": {"training.ckpt.manager"}, "training.node.datasync": {"training.ckpt.storage"}}
    assert _layer_violations(ok) == []
    wrong = {**ok, "training.ckpt.storage": {"training.node.datasync"}, "training.ckpt.hf": {"training.trainer"},
             "training.node.guard": {"training.trainer.config"}, "training.trainer.bench": {"training.node.guard"}}
    assert _layer_violations(wrong) == ["training.ckpt.hf -> training.trainer", "training.ckpt.storage -> training.node.datasync",
                                        "training.node.guard -> training.trainer.config",
                                        "training.trainer.bench -> training.node.guard"]
