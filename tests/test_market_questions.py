"""One place answers what a node group's market is (spot? on-demand? prepaid? a reservation, and
which kind? does it burst to spot?): the `Market` model in infra/model/spec_capacity.py. Everywhere
else in infra/ and policies/ asks it. Outside that module, a market's name (spot, on-demand,
reserved, capacity-block, ...) compared with, tested for membership against, used as a dict key
of, looked up with or matched as a prefix of any expression fails here, naming file:line —
whatever that expression is (`m.type`, a copy of it, `m.get("type")`, an `Ask`'s market string).
ALLOWED lists the few lines where such a name is another concept, each with why."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import get_args

from infra.model.spec_capacity import Market
from tests.harness import ROOT

# The market names, as the spec model spells them.
MARKETS = frozenset(get_args(Market.model_fields["type"].annotation))
HOME = ROOT / "infra" / "model" / "spec_capacity.py"
SCANNED = ("infra", "policies")

# Lines where a market's name means something else, by file and the line's text (so that an edit
# above them does not move the entry); each must still be found (no stale entries).
ALLOWED = {
    # Kueue ResourceFlavors are labelled with the market their pool's nodes carry (a Kubernetes label's
    # value, read back from a Flavor), a different concept from a group's Market.
    "infra/teams/queues.py": ('hourly = rg.prices.spot if market == "spot" else rg.prices.on_demand',
                              'if flavor.market == "on-demand" else "lower the teams\' quotas'),
    "infra/k8s/queues.py": ('key=lambda n: (flavors[n].market != "spot", n)',),
    # EC2's reserved tag-key words and a cloud's reserved VPC range (infra/data/constraints.yaml).
    "infra/checks/cloud_rules.py": ('k in imds["reserved"]',),
    "infra/checks/value_checks.py": ('reserved = rule.get("reserved")',),
    # The plan's spot price-cap basis text ("on-demand price (no cap given)": infra/resolve/cost.py).
    "infra/plan/report.py": ('g["spot_max_price_basis"].startswith("on-demand")',),
}


def _names(node: ast.AST) -> bool:
    """A market's name, or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in MARKETS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names(e) for e in node.elts)
    return False


def _prefix(node: ast.AST) -> bool:
    """A string a market's name starts or ends with (`.startswith("capacity")`)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 3 and any(
        m.startswith(node.value) or m.endswith(node.value) for m in MARKETS)


def _literal_args(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `Literal[...]`: a type's spelling of the names, not a comparison."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal":
            inside.update(id(n) for n in ast.walk(node))
    return inside


def _hit(node: ast.AST) -> bool:
    """A market's name compared with, or looked up by, any expression: `x == "spot"`, `x in
    ("reserved",)`, a name bound to a collection of them, a dict keyed by them (its `.get` and `[]`
    are then lookups by a market's name), `.get("spot")`, `.startswith("capacity")`, `case "spot":`."""
    if isinstance(node, ast.Compare):
        return any(_names(s) for s in (node.left, *node.comparators))
    if isinstance(node, ast.Dict):
        return any(k is not None and _names(k) for k in node.keys)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return _names(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("startswith", "endswith", "removeprefix", "removesuffix"):
            return any(_prefix(a) or _names(a) for a in node.args)
        return node.func.attr in ("get", "pop", "setdefault", "index", "count") and any(_names(a) for a in node.args)
    if isinstance(node, ast.Subscript):
        return _names(node.slice)
    if isinstance(node, ast.alias):
        return node.name == "RESERVATIONS"  # the model's own tuple of names, imported to compare with
    return isinstance(node, ast.MatchValue) and _names(node.value)


def raw_comparisons(source: str) -> list[int]:
    """Lines where a market's name is compared with, held for a comparison, or looked up by an
    expression (whatever that expression is: `m.type`, a copy of it, `m.get("type")`, ...)."""
    tree = ast.parse(source)
    skip = _literal_args(tree)
    return sorted({node.lineno for node in ast.walk(tree)
                   if id(node) not in skip and hasattr(node, "lineno") and _hit(node)})


def _sources() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def _allowed(path: Path, text: str) -> bool:
    return any(a in text for a in ALLOWED.get(path.relative_to(ROOT).as_posix(), ()))


def test_only_the_market_model_compares_a_markets_name() -> None:
    sources = _sources()
    assert len(sources) > 50 and HOME in sources  # the walk found the packages
    found, used = [], set()
    for p in sources:
        lines = p.read_text(encoding="utf-8").splitlines()
        for line in raw_comparisons("\n".join(lines)) if p != HOME else []:
            allowed = [a for a in ALLOWED.get(p.relative_to(ROOT).as_posix(), ()) if a in lines[line - 1]]
            used.update(allowed)
            if not allowed:
                found.append(f"{p.relative_to(ROOT)}:{line}")
    assert not found, ("compare a market's name only in infra/model/spec_capacity.py (Market); ask it instead "
                       f"(market.spot, .prepaid, .reservation, ...): {', '.join(found)}")
    stale = {a for entries in ALLOWED.values() for a in entries} - used
    assert not stale, f"ALLOWED entries no longer found (remove them): {sorted(stale)}"


def test_the_market_model_is_where_the_comparisons_are() -> None:
    assert raw_comparisons(HOME.read_text(encoding="utf-8"))  # the scan recognises the model's own


def test_the_model_points_at_this_scan() -> None:
    """The model's comment names the test that holds its one-place rule: this file."""
    named = re.findall(r"tests/\w+\.py", inspect.getsource(Market))
    assert named == [Path(__file__).relative_to(ROOT).as_posix()]


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
        # a copy of the type, another spelling of it, a name bound to the names, a prefix, a table
        'kind = m.type\nif kind == "spot":\n    pass',
        'x = m.get("type") == "spot"',
        'x = getattr(m, "type") == "reserved"',
        'PAID = ("reserved",)\nx = m.type in PAID',
        'x = m.type.startswith("capacity")',
        'CHARGE = {"spot": "SPOTPAID"}\nx = CHARGE.get(m.type)',
        'x = ask.market != "spot"',
        'from infra.model.spec_capacity import RESERVATIONS',
    ]
    missed = [f for f in forms if not raw_comparisons(f)]
    assert not missed, f"the scan misses: {missed}"
    assert raw_comparisons('kind = m.type\nif kind == "spot":\n    pass') == [2]
    # a market's name in a message or a Literal type, or a lookup by the type, is not one
    assert raw_comparisons('x = f"{m.type} is spot"\ny = notice_s(cloud, m.type)\n'
                           'z: Literal["spot", "reserved"] | None = None') == []
