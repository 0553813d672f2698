"""The `make diff` report as Markdown: what a pull request comment shows per stack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MARKER = "<!-- gpu-training-stack: make diff -->"  # the comment CI updates in place


def _money(value: float | None) -> str:
    return "–" if value is None else f"${value:,.0f}"


def _delta(d: Mapping[str, Any]) -> str:
    sign = "+" if d["delta"] > 0 else ""
    pct = "" if d["percent"] is None else f" ({sign}{d['percent']:.1f}%)"
    return f"{sign}${d['delta']:,.0f}{pct}"


def _resources(res: Mapping[str, Any]) -> list[str]:
    out = [f"**{len(res['added'])} to add, {len(res['changed'])} to change, {len(res['removed'])} to remove, "
           f"{len(res['replaced'])} to replace**", ""]
    if res["replaced"]:
        out += ["> [!WARNING]", "> **Replaced or deleted: resources that hold data or capacity**"]
        out += [f"> - `{r['type']}` **{r['name']}**: {r['why']}" for r in res["replaced"]]
        out.append("")
    rows = ([("+ add", r["type"], r["name"], "") for r in res["added"]]
            + [("~ change", r["type"], r["name"], ", ".join(r["inputs"]) or f"renamed from {r['renamedFrom']}")
               for r in res["changed"]]
            + [("- remove", r["type"], r["name"], "") for r in res["removed"]])
    if rows:
        out += ["<details><summary>resources</summary>", "", "| | type | name | inputs |", "|---|---|---|---|"]
        out += [f"| {a} | `{t}` | {n} | {i} |" for a, t, n, i in rows]
        out += ["", "</details>", ""]
    return out


def _cost(cost: Mapping[str, Any]) -> list[str]:
    t = cost["total"]
    out = [f"**Cost:** {_money(t['before'])} → {_money(t['after'])} per month, {_delta(t)}", "",
           "| cloud | before $/month | after $/month | change |", "|---|---:|---:|---:|"]
    out += [f"| {c} | {_money(d['before'])} | {_money(d['after'])} | {_delta(d)} |" for c, d in cost["by_cloud"].items()]
    if cost["node_groups"]:
        out += ["", "| node group | before $/month | after $/month | change |", "|---|---:|---:|---:|"]
        out += [f"| {g} | {_money(d['before'])} | {_money(d['after'])} | {_delta(d)} |"
                for g, d in cost["node_groups"].items()]
    return out + [""]


def _policies(v: Mapping[str, Any]) -> list[str]:
    if not v["new"] and not v["resolved"]:
        return ["**Policies:** no verdict changes", ""]
    out = ["**Policies:**"]
    out += [f"- :x: new {x['enforcement']} `{x['policy']}` on {x['resource']}: {x['message']}" for x in v["new"]]
    out += [f"- :white_check_mark: resolved `{x['policy']}` on {x['resource']}" for x in v["resolved"]]
    return out + [""]


def render(reports: Sequence[Mapping[str, Any]], base: str, errors: Mapping[str, str] | None = None) -> str:
    out = [MARKER, f"## Plan diff against `{base}`", ""]
    for report in reports:
        out += [f"### stack `{report['stack']}`", ""]
        out += _resources(report["resources"]) + _cost(report["cost"]) + _policies(report["violations"])
    for stack, message in (errors or {}).items():
        out += [f"### stack `{stack}`", "", f":x: the plan failed: `{message}`", ""]
    return "\n".join(out).rstrip() + "\n"
