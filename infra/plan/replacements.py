"""What `pulumi up` would delete and recreate among the stateful resources, between two plans
(the `make plan FORMAT=json` documents of a base and of now): a resource whose URN changes —
a new name, type or parent — is a different resource to Pulumi unless an alias names the old
URN, and one whose provider changes is replaced too. For buckets that means an empty new bucket
(and, protected, a failed update); for a cluster, every running Job."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def replacements(base: Iterable[Mapping[str, Any]], now: Iterable[Mapping[str, Any]],
                 stateful: Mapping[str, str], replace_on: Mapping[str, Iterable[str]] | None = None
                 ) -> list[dict[str, str]]:
    """One entry per stateful resource of `base` that `now` would replace or delete:
    {urn, type, name, why}. `stateful`: type -> what it holds; `replace_on`: type -> inputs
    whose change makes the provider replace it (both from infra/data/stateful.yaml)."""
    replace_on = replace_on or {}
    current = {r["urn"]: r for r in now}
    aliased = {alias for r in current.values() for alias in r.get("aliases", [])}
    before = {r["urn"] for r in base}
    found = []
    for old in base:
        if old["type"] not in stateful:
            continue
        holds = stateful[old["type"]]
        new = current.get(old["urn"])
        if new is not None:
            if new.get("provider", "") != old.get("provider", ""):
                found.append(_entry(old, f"its provider changes ({old.get('provider')} -> {new.get('provider')}): "
                                         f"Pulumi replaces it, and with it {holds}"))
            for key in replace_on.get(old["type"], ()):
                before, after = old.get("inputs", {}).get(key), new.get("inputs", {}).get(key)
                if before != after:
                    found.append(_entry(old, f"{key} changes ({before!r} -> {after!r}), which the provider cannot "
                                             f"change in place: it replaces the resource, and with it {holds}"))
            continue
        if old["urn"] in aliased:
            continue
        # A new resource of the same kind (or the same name) that was not there before: most
        # likely this one renamed or moved, which Pulumi cannot know without an alias.
        moved = [r["urn"] for r in current.values() if r["urn"] not in before
                 and (r["type"] == old["type"] or r["name"] == old["name"])]
        why = (f"its URN changes (a new name, type or parent; the plan now has {moved[0]}): Pulumi deletes it and "
               f"creates a new one, losing {holds}; add aliases=[pulumi.Alias(...)] naming the old URN" if moved else
               f"it is no longer in the program: `pulumi up` deletes it and {holds}")
        found.append(_entry(old, why))
    return found


def _entry(res: Mapping[str, Any], why: str) -> dict[str, str]:
    return {"urn": str(res["urn"]), "type": str(res["type"]), "name": str(res["name"]), "why": why}
