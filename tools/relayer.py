"""Group infra/'s flat modules into one package per layer (issue #45), mechanically, so that it can
be run again on a tree that has moved on (new modules, a merged branch):

    .venv/bin/python tools/relayer.py                 # move, rewrite every reference, report
    .venv/bin/python tools/relayer.py --check         # say what it would do; exit 1 if anything
    .venv/bin/python tools/relayer.py --move-pinned   # the PINNED modules too (changes the plans)

Each module keeps its file name and gains its layer's folder: infra/spec.py becomes
infra/model/spec.py, `from infra import spec` becomes `from infra.model import spec`. Every
reference is rewritten: Python imports (by their syntax tree), and the dotted names and paths in
any tracked text (`infra.spec.StackSpec` patch targets, `python -m infra.x`, `infra/spec.py` in
docs, `"infra" / "spec.py"` in tests). It refuses, naming them, modules in infra/ it has no layer
for (add them to LAYERS), and it is idempotent: on a moved tree it changes nothing, except that
it also rewrites references a later change made to a moved module's old name.

The layers, bottom to top (a layer imports only its own and lower ones; tests/test_layers.py holds
that): LAYERS below, then infra/k8s beside render, the clouds' resource modules, and the CLIs.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "core": ("The foundations every layer may use: errors, the plan's clock, YAML reading, the GPU catalog\n"
             "and its data files (infra/data/), physical names and cron schedules. Imports no other layer.",
             ("errors", "clock", "yamlread", "catalog", "schedule", "names")),
    "model": ("The stack spec: the typed, frozen model of a stack file (spec.py and its parts), its text and\n"
              "patterns, the problems it names, and what follows from the spec alone (tags, images, node\n"
              "pools, scrape sources). Imports core and the cloud profiles (infra/clouds, plain data).",
              ("spec", "spec_base", "spec_capacity", "spec_patterns", "spec_problems", "stacktext", "tags",
               "images", "pools", "scrape")),
    "resolve": ("The resolved stack: each node group with its cloud's answers (resolved, groups), its fabric,\n"
                "shared file systems, bucket and grants, the trainer contract, the rendezvous store, spares,\n"
                "the pod's shape and the cost. Imports model and core; no Pulumi resource code.",
                ("buckets", "fabric", "fabric_plan", "resolved", "contract", "groups", "rendezvous", "spares",
                 "sharedfs", "access", "pods", "gpu_health", "cost")),
    "checks": ("The check phase: what a stack is judged by before any resource exists (validation.py runs\n"
               "them all: values, each cloud's rules, the resolved groups, the training commands). Imports\n"
               "resolve and below; no Pulumi resource code.",
               ("value_checks", "cloud_rules", "resolved_checks", "commands", "validation")),
    "render": ("What the stack writes for nodes and clouds: the user data and the node agents' settings, the\n"
               "node bundle, the trainer image, monitoring, and which resources are protected. infra/k8s (the\n"
               "Kubernetes objects) sits beside it. Imports checks and below.",
               ("userdata", "node_settings", "bundle", "image", "monitoring", "protection")),
    "stack": ("The stack end to end: a stack file read and checked (stackfile), the Pulumi program that\n"
              "builds it (program), the policy pack's config. Only the CLIs (infra/cli, plan, teams,\n"
              "capacity, prices) sit above it.",
              ("stackfile", "program", "policy_config")),
}
ORDER = tuple(LAYERS)
MODULE_LAYER = {module: layer for layer, (_, modules) in LAYERS.items() for module in modules}

# Modules whose path is written in a file whose bytes reach a plan (PLAN_BYTES): rewriting that
# note changes the trainer image's content tag or the nodes' user data, so every stack's plan. They
# stay in infra/ until a change that rebuilds the image anyway moves them (--move-pinned).
PINNED: dict[str, str] = {
    "image": "training/Dockerfile, training/Dockerfile.dockerignore",
    "pods": "training/Dockerfile (TRAINER_UID note)",
    "contract": "training/contract.py",
    "fabric": "training/contract.py",
    "userdata": "cloudinit/node.yaml.j2, cloudinit/node.env.j2 (and the golden user data)",
    "buckets": "cloudinit/scripts/gts-image.py",
    "rendezvous": "cloudinit/units/gts-rdzv.service",
    "monitoring": "infra/data/gpu_health.yaml (in the node bundle)",
}
# The trainer image's inputs (infra/image.py SOURCES), the node bundle's (infra/bundle.py FILES)
# and what the user data embeds; tests/test_layers.py checks the first two against the code.
PLAN_BYTES = ("training/**", "cloudinit/**", "tests/golden/**", "infra/clouds/*/node.py", "infra/clouds/*/metadata.py",
              "infra/clouds/*/*.sh",
              "infra/data/gpu_health.yaml")
SELF = ("tools/relayer.py",)
LINES = 400  # a source file's limit


class Refused(SystemExit):
    pass


def _glob_match(path: str, pattern: str) -> bool:
    regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
    return re.fullmatch(regex, path) is not None


def plan_bytes(path: str) -> bool:
    return any(_glob_match(path, p) for p in PLAN_BYTES)


def _name_pattern(modules: dict[str, str]) -> re.Pattern[str]:
    names = "|".join(sorted(map(re.escape, modules), key=lambda n: (-len(n), n)))
    return re.compile(rf"(?<![\w.\-])infra([./])({names})(?!\w)")


def _segment_pattern(modules: dict[str, str]) -> re.Pattern[str]:
    names = "|".join(sorted(map(re.escape, modules), key=lambda n: (-len(n), n)))
    return re.compile(rf"""(["'])infra\1(\s*/\s*)(["'])({names})\.py\3""")


def _import_lines(node: ast.ImportFrom, modules: dict[str, str], indent: str) -> list[str] | None:
    """`from infra import a, b as c` split by where each name now lives; None if nothing moved."""
    if not any(a.name in modules for a in node.names):
        return None
    groups: dict[str, list[str]] = {}
    for a in node.names:
        home = f"infra.{modules[a.name]}" if a.name in modules else "infra"
        groups.setdefault(home, []).append(a.name + (f" as {a.asname}" if a.asname else ""))
    return [f"{indent}from {home} import {', '.join(names)}" for home, names in sorted(groups.items())]


def rewrite_imports(text: str, path: str, modules: dict[str, str]) -> str:
    """`from infra import <moved>` statements, by the syntax tree (the dotted forms are plain text)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and path.startswith("infra/"):  # a move would change what it points at, silently
            raise Refused(f"{path}:{node.lineno}: a relative import in infra/; write it absolute first")
        if node.level or node.module != "infra":
            continue
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]  # type: ignore[operator]
        indent, tail = first[:node.col_offset], last[node.end_col_offset:]
        if indent.strip() or tail.strip() and not tail.strip().startswith("#"):
            raise Refused(f"{path}:{node.lineno}: an import sharing its line with other code")
        new = _import_lines(node, modules, indent)
        if new is not None:
            new[-1] += tail.rstrip("\n").rstrip() if tail.strip() else ""
            edits.append((node.lineno - 1, node.end_lineno, [n + "\n" for n in new]))  # type: ignore[arg-type]
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    return "".join(lines)


_IMPORT = re.compile(r"^(\s*)from (infra[\w.]*) import ([\w, ]+)\n$")


def _name_key(name: str) -> tuple[int, str]:
    """isort's order: constants, classes, then the rest."""
    base = name.split(" as ")[0]
    return (0 if base.isupper() else 1 if base[:1].isupper() else 2, base)


def _sorted_run(run: list[str]) -> list[str]:
    """One run of single-line `from infra... import` statements ordered by module, as they were
    before the layer prefixes; two statements of one module become one where it fits a line."""
    indent = _IMPORT.match(run[0])[1]  # type: ignore[index]
    merged: dict[str, list[str]] = {}
    for line in run:
        m = _IMPORT.match(line)
        merged.setdefault(m[2], []).extend(n.strip() for n in m[3].split(","))  # type: ignore[index]
    out = []
    for module, names in sorted(merged.items()):
        own = [ln for ln in run if _IMPORT.match(ln)[2] == module]  # type: ignore[index]
        one = f"{indent}from {module} import {', '.join(sorted(set(names), key=_name_key))}\n"
        out += [one] if len(own) > 1 and len(one) <= 120 else own
    return out


def sort_imports(text: str) -> str:
    """Each run of consecutive single-line `from infra... import` statements (one indent, no
    comment) in order again."""
    out: list[str] = []
    run: list[str] = []
    for line in [*text.splitlines(keepends=True), ""]:
        m = _IMPORT.match(line)
        if m and (not run or _IMPORT.match(run[0])[1] == m[1]):  # type: ignore[index]
            run.append(line)
            continue
        out += _sorted_run(run) if run else []
        run = [line] if m else []
        out += [] if m else [line]
    return "".join(out)


def rewrite(text: str, path: str, modules: dict[str, str]) -> str:
    """A file's text with every reference to a moved module pointing at its layer's package."""
    if not modules:
        return text
    old = text
    if path.endswith(".py"):
        text = rewrite_imports(text, path, modules)
    text = _name_pattern(modules).sub(lambda m: f"infra{m[1]}{modules[m[2]]}{m[1]}{m[2]}", text)
    text = _segment_pattern(modules).sub(
        lambda m: f"{m[1]}infra{m[1]}{m[2]}{m[3]}{modules[m[4]]}{m[3]}{m[2]}{m[3]}{m[4]}.py{m[3]}", text)
    return sort_imports(text) if path.endswith(".py") and text != old else text


def loose_modules(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "infra").glob("*.py") if p.name != "__init__.py")


def moves_for(root: Path, move_pinned: bool) -> dict[str, str]:
    """module -> layer for the loose modules to move now; refuses the ones it has no layer for."""
    loose = loose_modules(root)
    unknown = [m for m in loose if m not in MODULE_LAYER]
    if unknown:
        raise Refused("infra/ holds modules tools/relayer.py has no layer for; add each to LAYERS "
                      "(or PINNED) and run it again:\n" + "\n".join(f"  infra/{m}.py" for m in unknown))
    moves = {m: MODULE_LAYER[m] for m in loose if move_pinned or m not in PINNED}
    clash = [m for m, layer in moves.items() if (root / "infra" / layer / f"{m}.py").exists()]
    if clash:
        raise Refused("both the old and the new file exist: " + ", ".join(f"infra/{m}.py" for m in clash))
    return moves


def rewritten_names(root: Path, moves: dict[str, str]) -> dict[str, str]:
    """The moves plus every module already moved whose old name is gone (a later change may still
    write it)."""
    done = {m: layer for m, layer in MODULE_LAYER.items()
            if (root / "infra" / layer / f"{m}.py").exists() and not (root / "infra" / f"{m}.py").exists()}
    return {**done, **moves}


_HERE = r"(Path\(__file__\)(?:\.resolve\(\))?)"


def deepen(text: str, path: str) -> str:
    """A moved module's paths from its own file, one folder deeper: `.parent` becomes
    `.parents[1]`, `.parents[n]` becomes `.parents[n+1]`; any other use of __file__ is refused."""
    text = re.sub(_HERE + r"\.parents\[(\d+)\]", lambda m: f"{m[1]}.parents[{int(m[2]) + 1}]", text)
    text = re.sub(_HERE + r"\.parent(?!s)", lambda m: f"{m[1]}.parents[1]", text)
    if len(re.findall(r"__file__", text)) != len(re.findall(_HERE + r"\.parents\[", text)):
        raise Refused(f"{path}: uses __file__ in a way the relayer cannot move; make it Path(__file__).parent(s)")
    return text


def edits_for(root: Path, files: list[str], names: dict[str, str], move_pinned: bool,
              moving: frozenset[str] = frozenset()) -> dict[str, str]:
    """path -> new text for every file whose text changes; refuses to touch a PLAN_BYTES file
    unless the pinned modules move too."""
    edits: dict[str, str] = {}
    for path in files:
        if path in SELF or not (root / path).is_file():
            continue
        try:
            text = (root / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        new = rewrite(text, path, names)
        new = deepen(new, path) if path in moving else new
        if new != text:
            edits[path] = new
    long = sorted(p for p, text in edits.items() if p.endswith(".py") and text.count("\n") > LINES)
    if long:
        raise Refused(f"these files would pass {LINES} lines (tests/test_structure.py); shorten them first:\n"
                      + "\n".join(f"  {p}" for p in long))
    held = sorted(p for p in edits if plan_bytes(p))
    if held and not move_pinned:
        raise Refused("these files reach a plan (PLAN_BYTES) and name a module about to move; add the "
                      "module to PINNED or pass --move-pinned:\n" + "\n".join(f"  {p}" for p in held))
    return edits


def face(layer: str) -> str:
    doc, modules = LAYERS[layer]
    return f'"""{doc}\n\nModules: {", ".join(modules)}."""\n'


def apply(root: Path, moves: dict[str, str], edits: dict[str, str], mv: Callable[[str, str], object],
          add: Callable[[str], object]) -> None:
    for layer in sorted(set(moves.values())):
        init = root / "infra" / layer / "__init__.py"
        if not init.exists():
            init.parent.mkdir(exist_ok=True)
            init.write_text(face(layer), encoding="utf-8")
            add(str(init.relative_to(root)))
    for module, layer in sorted(moves.items()):
        mv(f"infra/{module}.py", f"infra/{layer}/{module}.py")
    moved = {f"infra/{m}.py": f"infra/{layer}/{m}.py" for m, layer in moves.items()}
    for path, text in sorted(edits.items()):
        (root / moved.get(path, path)).write_text(text, encoding="utf-8")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say what would change (exit 1 if anything)")
    parser.add_argument("--move-pinned", action="store_true", help="move PINNED too and rewrite PLAN_BYTES files")
    args = parser.parse_args(argv)
    root = Path(_git(Path.cwd(), "rev-parse", "--show-toplevel").strip())
    try:
        moves = moves_for(root, args.move_pinned)
        names = rewritten_names(root, moves)
        moving = frozenset(f"infra/{m}.py" for m in moves)
        edits = edits_for(root, _git(root, "ls-files").splitlines(), names, args.move_pinned, moving)
    except Refused as refused:
        print(f"relayer: refused: {refused}", file=sys.stderr)
        return 2
    for module, layer in sorted(moves.items()):
        print(f"move infra/{module}.py -> infra/{layer}/{module}.py")
    for path in sorted(edits):
        print(f"rewrite {path}")
    if args.check or not (moves or edits):
        print("relayer: nothing to do" if not (moves or edits) else "relayer: --check, nothing changed")
        return 1 if args.check and (moves or edits) else 0
    apply(root, moves, edits, mv=lambda a, b: _git(root, "mv", a, b), add=lambda p: _git(root, "add", p))
    print(f"relayer: moved {len(moves)} modules, rewrote {len(edits)} files; review `git diff --stat -M` and commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
