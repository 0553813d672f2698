"""YAML read the way the Pulumi CLI reads a stack file, bounded in work: stack files and
teams.yaml are read with `load` (infra/stacktext.py, infra/teams/registry.py).

- Scalars resolve as gopkg.in/yaml.v3 (the CLI's reader) resolves them into an untyped value:
  only true/false are booleans (`yes`, `on` are text), a date is text, there are no base-60
  numbers (`50:00` is text), and a number too large for a float (`1.0e+400`) is text. `1_000`
  is text too (YAML 1.2's core schema; yaml.v3 would drop the underscores), so a numeric key
  refuses it with the number to write instead of two readers disagreeing.
- Merge keys (`<<: *base`) work as the YAML 1.1 merge-key type says: the merged pairs are
  inserted "unless the key already exists", so a key both merged and written is not a
  duplicate (the written one applies); in a list of merged maps the first wins. A key written
  twice in one mapping is refused, `<<` included (merge several with `<<: [*a, *b]`).
- Tags: only the core schema's (!!str, !!int, !!float, !!bool, !!null, !!map, !!seq) and the
  merge key; `!!binary`, `!!set`, `!!timestamp`, `!!python/...` and local tags are refused
  naming the key.
- Work is bounded before anything is built: at most MAX_NODES nodes counting every alias
  expansion (a billion-laughs file stops at once), nesting at most MAX_DEPTH levels, and the
  text at most MAX_BYTES.

Every refusal is a YamlError with the line and the key path; nothing here reads a file.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_NODES = 100_000  # nodes after alias expansion: the shipped stack files hold under 2,000
MAX_DEPTH = 64  # levels of nesting: the spec's deepest key is six
MAX_BYTES = 1 << 20  # a stack file is a few KB

_CORE = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, MAP, SEQ, MERGE = (_CORE + t for t in
                                                 ("str", "int", "float", "bool", "null", "map", "seq", "merge"))
_SCALAR_TAGS = {STR, INT, FLOAT, BOOL, NULL}

# yaml.v3's resolve.go, as regular expressions (Go's ParseInt with base 0, then its float form).
_INT = re.compile(r"^[-+]?(?:0[bB][01]+|0[oO][0-7]+|0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_INF_NAN = re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


class YamlError(Exception):
    """Text that cannot be read as a stack file: `line` (1-based, or None) and what is wrong."""

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(message)
        self.line = line


class _Rules:
    """yaml.v3's implicit types and a checked, bounded document, for either of PyYAML's parsers."""

    def construct_v3_int(self, node: ScalarNode) -> int:
        text = str(self.construct_scalar(node))  # type: ignore[attr-defined]
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        if digits[:2].lower() in ("0b", "0o", "0x"):
            return sign * int(digits, 0)
        return sign * (int(digits, 8) if len(digits) > 1 and digits[0] == "0" else int(digits))

    def construct_v3_float(self, node: ScalarNode) -> float | str:
        text = str(self.construct_scalar(node))  # type: ignore[attr-defined]
        if _INF_NAN.match(text):
            return math.nan if "nan" in text.lower() else (-math.inf if text[0] == "-" else math.inf)
        value = float(text)
        return value if math.isfinite(value) else text  # out of a float's range: yaml.v3 keeps the text

    def get_single_data(self) -> Any:
        node = self.get_single_node()  # type: ignore[attr-defined]
        if node is None:
            return None
        _Checker(self).check(node)
        return self.construct_document(node)  # type: ignore[attr-defined]


class _CLoader(_Rules, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml's parser where PyYAML has it (the plan reads a dozen stack files: the pure-Python
    parser was a fifth of its time). Its composer recurses in C, so it only gets text that
    cannot nest deeper than C_DEPTH (see `load`)."""


class _PyLoader(_Rules, yaml.SafeLoader):
    """The pure-Python parser, for text that might nest deeply: its composer recurses in Python
    (a RecursionError, not a crash), and stops after MAX_NODES nodes."""

    composed = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self.composed += 1
        if self.composed > MAX_NODES:
            raise YamlError(None, f"holds more than {MAX_NODES:,} values; a stack file is a few KB")
        return super().compose_node(parent, index)


C_DEPTH = 4000  # libyaml's composer handled 10,000 levels and crashed at 100,000 here


for _loader in (_CLoader, _PyLoader):
    _loader.yaml_implicit_resolvers = {}
    for _first, _tag, _pattern in (
            (list("tTfF"), BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")),
            (["~", "n", "N", ""], NULL, re.compile(r"^(?:~|null|Null|NULL|)$")),
            (list("-+0123456789"), INT, _INT),
            (list("-+.0123456789"), FLOAT, _FLOAT),
            (list("-+."), FLOAT, _INF_NAN),
            (["<"], MERGE, re.compile(r"^<<$"))):
        _loader.add_implicit_resolver(_tag, _pattern, _first)
    # The core schema's; None: SafeConstructor's "could not determine a constructor" for any other tag.
    _loader.yaml_constructors = {tag: f for tag, f in _loader.yaml_constructors.items()
                                 if tag in _SCALAR_TAGS | {MAP, SEQ, None}}
    _loader.yaml_constructors[INT] = _Rules.construct_v3_int
    _loader.yaml_constructors[FLOAT] = _Rules.construct_v3_float


def _short(tag: str) -> str:
    return "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag


class _Checker:
    """One walk over the composed document before anything is built: tags, keys given twice,
    merge values, nesting and the expanded size (every alias counted where it is used)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.seen: set[int] = set()  # mappings whose keys are checked (an alias is checked once)
        self.count = 0

    def check(self, root: Node) -> None:
        stack: list[tuple[Node, str, int]] = [(root, "", 0)]
        while stack:
            node, path, depth = stack.pop()
            self.count += 1
            where = (path if len(path) <= 80 else path[:77] + "...") or "the document"
            if self.count > MAX_NODES:
                raise YamlError(_line(node), f"{where}: more than {MAX_NODES:,} values once aliases are expanded "
                                             "(nested aliases that multiply); write the values out")
            if depth > MAX_DEPTH:
                raise YamlError(_line(node), f"{where}: nested deeper than {MAX_DEPTH} levels (or an alias used "
                                             "inside its own anchor)")
            self._tag(node, where)
            if isinstance(node, SequenceNode):
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in reversed(list(enumerate(node.value))))
            elif isinstance(node, MappingNode):
                stack.extend(reversed(self._mapping(node, path, depth)))

    def _tag(self, node: Node, where: str) -> None:
        tag = node.tag
        if isinstance(node, ScalarNode) and tag in _SCALAR_TAGS:
            implicit = self.loader.resolve(ScalarNode, node.value, (True, False))
            if tag in (STR, implicit) or (tag == FLOAT and implicit == INT):
                return
            raise YamlError(_line(node), f"{where}: {node.value!r} is not a {_short(tag)}; remove the tag")
        if (isinstance(node, MappingNode) and tag == MAP) or (isinstance(node, SequenceNode) and tag == SEQ):
            return
        if tag == MERGE:
            raise YamlError(_line(node), f"{where}: '<<' (a merge key) is only a key; quote it for the text '<<'")
        raise YamlError(_line(node), f"{where}: the tag {_short(tag)} is not read in a stack file (Pulumi's config "
                                     "holds text, numbers, true/false, lists and mappings); remove the tag and write "
                                     "the value as plain text")

    def _mapping(self, node: MappingNode, path: str, depth: int) -> list[tuple[Node, str, int]]:
        children: list[tuple[Node, str, int]] = []
        keys: dict[tuple[str, Any], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE:
                self._merge(value_node, f"{path}.<<" if path else "<<")
                key = ("merge", "<<")
                children.append((value_node, f"{path}.<<" if path else "<<", depth + 1))
            else:
                if not isinstance(key_node, ScalarNode):
                    raise YamlError(_line(key_node), f"{path or 'the document'}: a key is a "
                                    f"{'list' if isinstance(key_node, SequenceNode) else 'mapping'}; keys are plain text")
                self._tag(key_node, f"{path or 'the document'}: key {key_node.value!r}")
                value = self.loader.construct_object(key_node)
                key = (type(value).__name__, value)
                children.append((value_node, f"{path}.{value}" if path else str(value), depth + 1))
            if id(node) not in self.seen and key in keys:
                shown = "<<" if key[0] == "merge" else key[1]
                fix = "; merge several with `<<: [*a, *b]`" if key[0] == "merge" else ""
                raise YamlError(_line(key_node), f"key {shown!r} is given twice; keep one (the file must say one "
                                                 f"thing once){fix}")
            keys[key] = _line(key_node) or 0
        self.seen.add(id(node))
        return children

    def _merge(self, value: Node, where: str) -> None:
        maps = value.value if isinstance(value, SequenceNode) else [value]
        if not all(isinstance(m, MappingNode) for m in maps):
            raise YamlError(_line(value), f"{where}: a merge key takes a mapping or a list of mappings "
                                          "(`<<: *base` where `base: &base {...}`)")


def _line(node: Node) -> int | None:
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else None


def load(text: str) -> Any:
    """The document in `text`; a YamlError (line, key path and fix) when it cannot be read."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise YamlError(None, f"is larger than {MAX_BYTES // 1024} KiB; a stack file is a few KB")
    # Every level of nesting takes one of these characters: their count bounds the depth.
    shallow = sum(text.count(c) for c in "[{-?:\n") <= C_DEPTH
    try:
        return yaml.load(text, Loader=_CLoader if shallow else _PyLoader)  # noqa: S506 (SafeLoaders, narrowed)
    except RecursionError:
        raise YamlError(None, f"nests deeper than {MAX_DEPTH} levels") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        said = "; ".join(part for part in (exc.context, exc.problem) if part) or str(exc)
        raise YamlError(mark.line + 1 if mark else None, f"is not valid YAML: {said}") from None
    except yaml.YAMLError as exc:
        raise YamlError(None, f"is not valid YAML: {exc}") from None
