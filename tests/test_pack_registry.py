"""Policy rules are registered where they are written (`@stack_rule` / `@resource_rule`,
policies/gts_policy/registry.py): the pack's rules, in its order, are the table in
docs/policies.md (UPDATE_GOLDEN=1 rewrites the table from the registry), whatever order the rule
modules are imported in; every rule module is served; a name registered twice is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import pytest

from policies.gts_policy.resources import Res
from policies.gts_policy.rules import RULES, Rule
from tests.harness import ROOT

DOC = ROOT / "docs" / "policies.md"
BEGIN = "<!-- rules table: generated from the registry (tests/test_pack_registry.py) -->"
END = "<!-- end of rules table -->"


def _row(rule: Rule) -> str:
    kind = "stack" if rule.per_resource is None else "resource, remediates" if rule.remediate else "resource"
    settings = ", ".join(f"`{k}`" for k in rule.schema) or "-"
    return f"| `{rule.name}` | {kind} | {rule.enforcement} | {settings} | {rule.description} |"


def rules_table() -> str:
    head = ["| Rule | Kind | Default level | Settings | Checks |", "|---|---|---|---|---|"]
    return "\n".join([BEGIN, *head, *map(_row, RULES), END])


def test_the_docs_table_is_the_registered_rules() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{DOC.name} lacks its rules table between {BEGIN} and {END}"
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    if os.environ.get("UPDATE_GOLDEN"):
        DOC.write_text(text[:start] + rules_table() + text[stop:], encoding="utf-8")
        text = DOC.read_text(encoding="utf-8")
        stop = text.index(END) + len(END)
    assert text[start:stop] == rules_table(), "docs/policies.md's rules table is stale: UPDATE_GOLDEN=1 rewrites it"


def test_the_order_does_not_depend_on_the_import_order() -> None:
    """A fresh process that imports the capacity rules first (as infra/ may) gets the same pack."""
    code = ("import json; import policies.gts_policy.rules_capacity, policies.gts_policy.rules_security; "
            "from policies.gts_policy.rules import RULES; print(json.dumps([r.name for r in RULES]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [r.name for r in RULES]


def test_every_rule_module_is_served_and_every_rule_is_in_one() -> None:
    from policies.gts_policy import registry
    from policies.gts_policy.rules import RULE_MODULES

    modules = sorted(p.stem for p in (ROOT / "policies" / "gts_policy").glob("rules_*.py"))
    assert modules and sorted(m.__name__.rpartition(".")[2] for m in RULE_MODULES) == modules
    assert registry.modules() == {m.__name__ for m in RULE_MODULES}
    assert [r.name for m in RULE_MODULES for r in registry.registered(m)] == [r.name for r in RULES]
    assert len(RULES) == len({r.name for r in RULES}) > 0


def test_a_rule_registers_where_it_is_written_in_its_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from policies.gts_policy import registry

    monkeypatch.setattr(registry, "_BY_MODULE", {})
    module = ModuleType("gts_policy.rules_example")

    def check(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
        return []

    def per(r: Res, cfg: Mapping[str, Any]) -> list[str]:
        return []

    for f in (check, per):
        f.__module__ = module.__name__
    registry.stack_rule("first", "The first.", "advisory", {"n": {"type": "integer"}})(check)
    registry.resource_rule("second", "The second.", "mandatory")(per)
    assert [(r.name, r.enforcement, r.schema, r.check, r.per_resource) for r in registry.registered(module)] == [
        ("first", "advisory", {"n": {"type": "integer"}}, check, None), ("second", "mandatory", {}, None, per)]
    with pytest.raises(AssertionError, match="'first' is registered twice"):
        registry.stack_rule("first", "Again.", "advisory")(check)
