"""YAML read the way the Pulumi CLI reads a stack file, bounded in work: stack files and
teams.yaml are read with `load` (infra/model/stacktext.py, infra/teams/registry.py).

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
- Work is bounded before anything is built: at most MAX_NODES nodes and MAX_TEXT characters
  of scalars counting every alias expansion (a billion-laughs file stops at once, and so does
  a long value aliased thousands of times), nesting at most MAX_DEPTH levels, and the text at
  most MAX_BYTES. Each node's tag is checked once however often an alias repeats it, and key
  paths are links built into text only for a message, each key cut to 40 characters.
- Numbers as yaml.v3 decodes them: an integer beyond 64 bits is a float when decimal (text
  when beyond a float too), text when hex, octal or binary; `!!float 0x10` is 16.0. A value no
  constructor can read is still a YamlError, never a ValueError.

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
MAX_TEXT = 4 * MAX_BYTES  # characters of keys and values once aliases are expanded

_CORE = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, MAP, SEQ, MERGE = (_CORE + t for t in
                                                 ("str", "int", "float", "bool", "null", "map", "seq", "merge"))
_SCALAR_TAGS = {STR, INT, FLOAT, BOOL, NULL}

# yaml.v3's resolve.go, as regular expressions (Go's ParseInt with base 0, then its float form).
_INT = re.compile(r"^[-+]?(?:0[bB][01]+|0[oO][0-7]+|0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_INF_NAN = re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


def _number(text: str) -> int | float | str:
    """An int or float scalar as yaml.v3 decodes it into an untyped value: an integer that fits
    64 bits (int64, or uint64 when positive) is an int; a decimal one beyond that is Go's
    ParseFloat of it (a float, or the text when out of a float's range); a hex, octal or binary
    one beyond 64 bits stays text. No int() ever sees more than 64 bits (Python's 4,300-digit
    limit is a ValueError)."""
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text[1:] if text[:1] == "+" else text)
    if _INT.match(text) and len(digits) <= 66:  # '0b' and 64 binary digits at most
        if digits[:2].lower() in ("0b", "0o", "0x"):
            value = sign * int(digits, 0)
        else:
            value = sign * (int(digits, 8) if len(digits) > 1 and digits[0] == "0" else int(digits, 10))
        if -(1 << 63) <= value < (1 << 64):
            return value
    if _FLOAT.match(text):
        number = float(text)
        return number if math.isfinite(number) else text  # out of a float's range: yaml.v3 keeps the text
    return text


class YamlError(Exception):
    """Text that cannot be read as a stack file: `line` (1-based, or None) and what is wrong."""

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(message)
        self.line = line


class _Rules:
    """yaml.v3's implicit types and a checked, bounded document, for either of PyYAML's parsers."""

    def construct_v3_int(self, node: ScalarNode) -> int | float | str:
        return _number(str(self.construct_scalar(node)))  # type: ignore[attr-defined]

    def construct_v3_float(self, node: ScalarNode) -> int | float | str:
        text = str(self.construct_scalar(node))  # type: ignore[attr-defined]
        if _INF_NAN.match(text):
            return math.nan if "nan" in text.lower() else (-math.inf if text[0] == "-" else math.inf)
        value = _number(text)  # `!!float 0x10` is the integer's value as a float
        return float(value) if isinstance(value, int) else value

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


# A key path as links, (parent link, part): built into text only for a message (a path string per
# value cost tens of GB for a 500 KB key over a list of 100,000 values).
_Link = tuple[Any, str] | None
_PLAIN = re.compile(r"^[A-Za-z0-9_:/@<>+-][A-Za-z0-9_:./@<>+-]*$")


def _shown(value: Any, width: int = 40, quoted: bool = False, tag_ok: bool = False) -> str:
    """A key or value for a one-line message: plain keys as written, others quoted with escapes
    (a newline is \\n), cut to `width` characters."""
    plain = isinstance(value, str) and (_PLAIN.match(value) or tag_ok and value.isprintable() and " " not in value)
    text = value if plain and not quoted else repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _where(link: _Link) -> str:
    parts: list[str] = []
    while link is not None:
        link, part = link
        parts.append(part)
    path = "".join(p if p.startswith("[") else "." + p for p in reversed(parts)).lstrip(".")
    return (path if len(path) <= 120 else "..." + path[-117:]) or "the document"


class _Checker:
    """One walk over the composed document before anything is built: tags, keys given twice,
    merge values, nesting and the expanded size (every alias counted where it is used; each node
    checked once however often an alias repeats it)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.seen: set[int] = set()  # mappings whose keys are checked (an alias is checked once)
        self.tagged: set[int] = set()  # nodes whose tag is checked
        self.count = 0
        self.chars = 0

    def check(self, root: Node) -> None:
        stack: list[tuple[Node, _Link, int]] = [(root, None, 0)]
        while stack:
            node, link, depth = stack.pop()
            self.count += 1
            if self.count > MAX_NODES:
                raise YamlError(_line(node), f"{_where(link)}: more than {MAX_NODES:,} values once aliases are "
                                             "expanded (nested aliases that multiply); write the values out")
            if depth > MAX_DEPTH:
                raise YamlError(_line(node), f"{_where(link)}: nested deeper than {MAX_DEPTH} levels (or an alias "
                                             "used inside its own anchor)")
            if isinstance(node, ScalarNode):
                self.chars += len(node.value)
                if self.chars > MAX_TEXT:
                    raise YamlError(_line(node), f"{_where(link)}: more than {MAX_TEXT >> 20} MiB of text once "
                                                 "aliases are expanded (a long value aliased many times); write the "
                                                 "values out")
            if id(node) not in self.tagged:
                self._tag(node, link)
                self.tagged.add(id(node))
            if isinstance(node, SequenceNode):
                stack.extend((child, (link, f"[{i}]"), depth + 1) for i, child in reversed(list(enumerate(node.value))))
            elif isinstance(node, MappingNode):
                stack.extend(reversed(self._mapping(node, link, depth)))

    def _tag(self, node: Node, link: _Link, what: str = "") -> None:
        tag = node.tag
        if isinstance(node, ScalarNode) and tag in _SCALAR_TAGS:
            implicit = self.loader.resolve(ScalarNode, node.value, (True, False))
            if tag in (STR, implicit) or (tag == FLOAT and implicit == INT):
                return
            raise YamlError(_line(node), f"{_where(link)}{what}: {_shown(node.value)} is not a {_short(tag)}; "
                                         "remove the tag")
        if (isinstance(node, MappingNode) and tag == MAP) or (isinstance(node, SequenceNode) and tag == SEQ):
            return
        if tag == MERGE:
            raise YamlError(_line(node), f"{_where(link)}{what}: '<<' (a merge key) is only a key; quote it for the "
                                         "text '<<'")
        raise YamlError(_line(node), f"{_where(link)}{what}: the tag {_shown(_short(tag), 60, tag_ok=True)} is not read in a stack "
                                     "file (Pulumi's config holds text, numbers, true/false, lists and mappings); "
                                     "remove the tag and write the value as plain text")

    def _mapping(self, node: MappingNode, link: _Link, depth: int) -> list[tuple[Node, _Link, int]]:
        children: list[tuple[Node, _Link, int]] = []
        keys: dict[tuple[str, Any], str] = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE:
                self._merge(value_node, link)
                key: tuple[str, Any] = ("merge", "<<")
                children.append((value_node, (link, "<<"), depth + 1))
            else:
                if not isinstance(key_node, ScalarNode):
                    raise YamlError(_line(key_node), f"{_where(link)}: a key is a "
                                    f"{'list' if isinstance(key_node, SequenceNode) else 'mapping'}; keys are plain text")
                if id(key_node) not in self.tagged:
                    self._tag(key_node, link, f": key {_shown(key_node.value)}")
                    self.tagged.add(id(key_node))
                value = self.loader.construct_object(key_node)
                # Normalised as the built dict compares keys: 1, 1.0 and true are one key there.
                key = ("value", value)
                children.append((value_node, (link, _shown(value)), depth + 1))
            if id(node) not in self.seen and key in keys:
                raise YamlError(_line(key_node), self._twice(key, key_node.value, keys[key]))
            keys.setdefault(key, key_node.value)
        self.seen.add(id(node))
        return children

    @staticmethod
    def _twice(key: tuple[str, Any], written: str, first: str) -> str:
        if key[0] == "merge":
            return "key '<<' is given twice; keep one (the file must say one thing once); merge several with " \
                   "`<<: [*a, *b]`"
        if written != first:
            return (f"key {_shown(written, quoted=True)} is the same key as {_shown(first, quoted=True)} once "
                    f"read (both are {_shown(key[1])}); keep one (the file must say one thing once)")
        return f"key {_shown(key[1], quoted=True)} is given twice; keep one (the file must say one thing once)"

    def _merge(self, value: Node, link: _Link) -> None:
        maps = value.value if isinstance(value, SequenceNode) else [value]
        if not all(isinstance(m, MappingNode) for m in maps):
            raise YamlError(_line(value), f"{_where((link, '<<'))}: a merge key takes a mapping or a list of "
                                          "mappings (`<<: *base` where `base: &base {...}`)")


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
        raise YamlError(None, f"is not valid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, OverflowError) as exc:  # a scalar no constructor above reads: still one line
        raise YamlError(None, f"holds a value that cannot be read ({_shown(str(exc), 120)}); write it as plain "
                              "text in quotes") from None
