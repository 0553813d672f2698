"""What a change does, stack by stack: two `make plan --format json` documents (a base and a
head) compared — resources added, changed (which inputs), removed and replaced, where a
replacement of a resource that holds data or capacity is flagged loudly; the monthly cost per
cloud and node group before and after; policy verdicts that are new or resolved. `make diff`
renders it as the Markdown a pull request comment shows."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from infra.core import catalog as cat
from infra.plan.replacements import replacements
from infra.render import protection


@functools.cache
def holders() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """type -> what it holds, type -> inputs that replace it: stateful and capacity resources."""
    holds = {t: s.why for t, s in protection.stateful_types().items()}
    replace_on = {t: s.replace_on for t, s in protection.stateful_types().items()}
    for t, v in cat.load_yaml("replacements.yaml")["types"].items():
        holds[t] = str(v["holds"])
        replace_on[t] = tuple(v.get("replaceOn") or ())
    return holds, replace_on


def _changed_inputs(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def diff_resources(base: list[dict[str, Any]], head: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    holds, replace_on = holders()
    before = {r["urn"]: r for r in base}
    after = {r["urn"]: r for r in head}
    moved = {alias: r["urn"] for r in head for alias in r.get("aliases", []) if alias in before}
    replaced = replacements(base, head, holds, replace_on)
    replaced_urns = {r["urn"] for r in replaced}
    added = [r for urn, r in after.items() if urn not in before and urn not in moved.values()]
    removed = [r for urn, r in before.items() if urn not in after and urn not in moved and urn not in replaced_urns]
    changed = []
    for urn, old in before.items():
        new = after.get(moved.get(urn, urn))
        if new is None or urn in replaced_urns:
            continue
        keys = _changed_inputs(old.get("inputs", {}), new.get("inputs", {}))
        if keys or urn in moved:
            changed.append({"urn": new["urn"], "type": new["type"], "name": new["name"], "inputs": keys,
                            "renamedFrom": urn if urn in moved else None})
    short = [{"urn": r["urn"], "type": r["type"], "name": r["name"]} for r in added]
    gone = [{"urn": r["urn"], "type": r["type"], "name": r["name"]} for r in removed]
    return {"added": short, "changed": changed, "removed": gone, "replaced": replaced}


def _delta(before: float, after: float) -> dict[str, float | None]:
    change = after - before
    return {"before": round(before, 2), "after": round(after, 2), "delta": round(change, 2),
            "percent": round(100 * change / before, 1) if before else None}


def diff_cost(base: Mapping[str, Any], head: Mapping[str, Any]) -> dict[str, Any]:
    clouds = sorted(set(base["by_cloud"]) | set(head["by_cloud"]))
    by_cloud = {c: _delta(base["by_cloud"].get(c, {}).get("monthly_usd", 0.0),
                          head["by_cloud"].get(c, {}).get("monthly_usd", 0.0)) for c in clouds}
    old_groups = {g["name"]: g for g in base["node_groups"]}
    new_groups = {g["name"]: g for g in head["node_groups"]}
    groups = {}
    for name in sorted(set(old_groups) | set(new_groups)):
        d = _delta(old_groups.get(name, {}).get("monthly_usd", 0.0), new_groups.get(name, {}).get("monthly_usd", 0.0))
        if d["delta"]:
            groups[name] = d
    return {"total": _delta(base["monthly_usd"], head["monthly_usd"]), "by_cloud": by_cloud, "node_groups": groups}


def _verdict_key(v: Mapping[str, str]) -> tuple[str, str, str]:
    return v["policy"], v["resource"], v["enforcement"]


def diff_violations(base: list[dict[str, str]], head: list[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    old = {_verdict_key(v) for v in base}
    new = {_verdict_key(v) for v in head}
    return {"new": [v for v in head if _verdict_key(v) not in old],
            "resolved": [v for v in base if _verdict_key(v) not in new]}


def diff_plans(base: Mapping[str, Any], head: Mapping[str, Any]) -> dict[str, Any]:
    return {"stack": head["stack"], "resources": diff_resources(base["resources"], head["resources"]),
            "cost": diff_cost(base["cost"], head["cost"]),
            "violations": diff_violations(base["violations"], head["violations"])}


def new_mandatory(report: Mapping[str, Any]) -> list[dict[str, str]]:
    return [v for v in report["violations"]["new"] if v["enforcement"] == "mandatory"]
