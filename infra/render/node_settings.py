"""The node agents' settings (infra/data/node_settings.yaml): every GTS_* variable a GPU node's
scripts, units and fetcher read, with who reads it, its default, who sets it and what it means.
The trainer's own variables are training/contract.py's table; this is the node side's.

Read and checked here (a pydantic model per entry: unknown keys, a bad name or an unknown
setter are refused); docs/node-bootstrap.md's table is generated from it (`make docs`,
infra/cli/docs.py), and tests/test_node_settings.py holds it to what the node's files read,
what node.env renders and what the Kubernetes Job's GPU gate sets."""

from __future__ import annotations

import functools
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from infra.core import catalog as cat

DATA = "node_settings.yaml"
NAME_PATTERN = r"^GTS_[A-Z0-9_]+$"
Setter = Literal["stack", "job", "operator", "tests"]
SETTERS: dict[str, str] = {  # a setter as the docs table says it
    "stack": "the stack (node.env)",
    "job": "the Kubernetes Job (its GPU gate)",
    "operator": "an operator (a unit drop-in)",
    "tests": "the tests",
}
FOLDERS = ("cloudinit/scripts/", "cloudinit/units/", "cloudinit/")  # left out of a reader's name in the docs


class Setting(BaseModel):
    """One GTS_* variable of the node agents."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    read_by: tuple[str, ...] = Field(description="the files that read it, as repository paths")
    default: str | None = Field(None, description="what its readers take when it is unset; None: no default")
    set_by: tuple[Setter, ...] = Field(description="who sets it; empty: nothing, its default applies")
    meaning: Annotated[str, Field(min_length=1)]


class NodeSettingsError(ValueError):
    """infra/data/node_settings.yaml is not a table of settings: which entry and what is wrong."""


@functools.cache
def load() -> tuple[Setting, ...]:
    """Every setting of infra/data/node_settings.yaml, in name order."""
    return parse(cat.load_yaml(DATA))


def parse(doc: dict[str, object]) -> tuple[Setting, ...]:
    """The settings of a read data file (its keys are the names); a NodeSettingsError names the
    entry that is out of shape and how."""
    entries = doc.get("settings")
    if not isinstance(entries, dict) or not entries:
        raise NodeSettingsError(f"infra/data/{DATA}: `settings` must map each GTS_* name to its entry")
    out = []
    for name, entry in sorted(entries.items()):
        try:
            out.append(Setting.model_validate({"name": name, **(entry or {})}))
        except (ValidationError, TypeError) as exc:
            raise NodeSettingsError(f"infra/data/{DATA}: settings.{name}: {exc}") from None
    return tuple(out)


def by_name() -> dict[str, Setting]:
    return {s.name: s for s in load()}


def _reader(path: str) -> str:
    for folder in FOLDERS:
        if path.startswith(folder):
            return path[len(folder):]
    return path


def _default(value: str | None) -> str:
    if value is None:
        return "—"
    if value == "":
        return "empty"
    return value if " " in value else f"`{value}`"


def rows() -> list[tuple[str, str, str, str, str]]:
    """The docs table's rows: variable, read by, default, set by, meaning (plain text; the docs
    generator escapes the cells)."""
    return [(f"`{s.name}`",
             ", ".join(f"`{_reader(p)}`" for p in s.read_by) or "nothing (node.env records it)",
             _default(s.default),
             ", ".join(SETTERS[w] for w in s.set_by) or "nothing (its default)",
             s.meaning) for s in load()]
