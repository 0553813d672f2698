"""One place answers what a node group's market is (spot? on-demand? prepaid? a reservation, and
which kind? does it take overflow?): the `Market` model in infra/spec_capacity.py. Everywhere
else in infra/ and policies/ asks it; a comparison of a market's type with a market's name
(`market.type == "spot"`, `m.type in ("capacity-block", ...)`, `{"reserved": ...}.get(market.type)`,
`x["market"]["type"] != "spot"`) outside that module fails here, naming file:line."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from infra.spec_capacity import Market
from tests.harness import ROOT

# The market names, as the spec model spells them.
MARKETS = frozenset(get_args(Market.model_fields["type"].annotation))
HOME = ROOT / "infra" / "spec_capacity.py"
SCANNED = ("infra", "policies")


def _names(node: ast.AST) -> bool:
    """A market's name, or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in MARKETS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names(e) for e in node.elts)
    return False


def _is_type(node: ast.AST) -> bool:
    """`<anything>.type` or `<anything>["type"]`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "type"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "type"


def _keyed_by_market(node: ast.AST) -> bool:
    return isinstance(node, ast.Dict) and any(k is not None and _names(k) for k in node.keys)


def raw_comparisons(source: str) -> list[int]:
    """Lines where a type is compared with a market's name, or a dict keyed by market names is
    looked up by a type."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_type(s) for s in sides) and any(_names(s) for s in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and _keyed_by_market(node.func.value) and any(_is_type(a) for a in node.args):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _keyed_by_market(node.value) and _is_type(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _is_type(node.subject) and any(
                isinstance(c.pattern, ast.MatchValue) and _names(c.pattern.value) for c in node.cases):
            lines.append(node.lineno)
    return sorted(set(lines))


def _sources() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def test_only_the_market_model_compares_a_markets_type() -> None:
    sources = _sources()
    assert len(sources) > 50 and HOME in sources  # the walk found the packages
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sources if p != HOME
             for line in raw_comparisons(p.read_text(encoding="utf-8"))]
    assert not found, ("compare a market's type only in infra/spec_capacity.py (Market); ask it instead "
                       f"(market.spot, .prepaid, .reservation, ...): {', '.join(found)}")


def test_the_market_model_is_where_the_comparisons_are() -> None:
    assert raw_comparisons(HOME.read_text(encoding="utf-8"))  # the scan recognises the model's own


def test_the_scan_finds_each_form_of_raw_comparison() -> None:
    forms = [
        'x = g.market.type == "spot"',
        'x = "reserved" != m.type',
        'x = m.type in ("capacity-block", "capacity-reservation")',
        'x = m.type not in {"spot"}',
        'x = {"reserved": 1, "on-demand": 2}.get(m.type, 3)',
        'x = {"reserved": 1}[m.type]',
        'x = r["market"]["type"] == "elasticity-assurance"',
        'match m.type:\n    case "spot":\n        pass',
    ]
    assert [raw_comparisons(f) for f in forms] == [[1]] * len(forms)
    # a market's name in a message, a lookup by the type, or another field's comparison is not one
    assert raw_comparisons('x = f"{m.type} is spot"\ny = notice_s(cloud, m.type)\nz = m.overflow == "spot"') == []
