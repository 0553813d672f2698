"""`make teams [TEAM=<name>] [FORMAT=json]`: every team's cost and quota, offline.

Regenerates the isolated teams' stack files from teams.yaml (`--check`: only says what differs,
as CI does), plans each team stack (or one) in the mock engine, reads the shared stack's plan for
the teams' ClusterQueues, and prints per team: resources, $/h and $/month, GPUs used vs granted
per cloud and model, violations; then the org's total against its limits. Exit 0 fine, 1 a
mandatory violation or a quota or org-limit breach (naming the team and the model), 2 an invalid
registry or team stack (or, with --check, generated files that differ from the registry), 3 an internal error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra.core import catalog as cat
from infra.core.errors import CatalogError, InputError, SpecError
from infra.model.spec import quota_of
from infra.plan.__main__ import build_plan
from infra.pods import LABEL_CLOUD, LABEL_TEAM
from infra.stack.stackfile import StackFileError, load_stack, project_root
from infra.teams import generate, queues, registry
from infra.teams.registry import Registry, RegistryError, Team

QUEUE_TYPE = "kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue"


@dataclass
class TeamReport:
    team: str
    placement: str
    stack: str  # the team's own stack, or the shared one
    resources: int
    hourly_usd: float  # isolated: the plan at rest; shared: its whole quota busy
    monthly_usd: float
    budget_usd: float
    gpus: list[dict[str, Any]] = field(default_factory=list)  # cloud, model, used, granted
    violations: list[dict[str, str]] = field(default_factory=list)

    @property
    def breached(self) -> bool:
        return any(v["enforcement"] == "mandatory" for v in self.violations)


def gpu_usage(plan: dict[str, Any]) -> dict[tuple[str, str], int]:
    """GPUs per (cloud, model) a plan's capacity can reach, counted by the policy pack's own rule."""
    from infra.plan.engine import unwrap_secrets
    from policies.gts_policy.resources import Res
    from policies.gts_policy.rules_cost import gpu_usage as pack_usage

    return pack_usage([Res(r["type"], r["name"], unwrap_secrets(r["inputs"]), r["protect"]) for r in plan["resources"]])


def isolated(team: Team, plan: dict[str, Any]) -> TeamReport:
    used = gpu_usage(plan)
    rows = [{"cloud": c, "model": m, "used": used.get((c, m), 0), "granted": g}
            for c, quota in sorted(team.gpus.items()) for m, g in sorted(quota.items())]
    rows += [{"cloud": c, "model": m, "used": n, "granted": 0} for (c, m), n in sorted(used.items())
             if m not in quota_of(team.gpus, c)]
    cost = plan["cost"]
    return TeamReport(team.name, team.placement, team.stack_name, len(plan["resources"]), cost["hourly_usd"],
                      cost["monthly_usd"], team.monthly_budget_usd, rows,
                      [{**v, "team": team.name} for v in plan["violations"]])


def shared(team: Team, plan: dict[str, Any], flavors: Mapping[str, dict[str, queues.Flavor]]) -> TeamReport:
    """A shared team: what its ClusterQueues grant in the shared stack's plan, priced at the
    flavors' GPU-hour (the showback of its whole quota busy); its objects there counted."""
    granted: dict[tuple[str, str], int] = {}
    hourly = 0.0
    owned = [r for r in plan["resources"]
             if ((r["inputs"].get("metadata") or {}).get("labels") or {}).get(LABEL_TEAM) == team.name]
    for r in owned:
        if r["type"] != QUEUE_TYPE:
            continue
        cloud = r["inputs"]["metadata"]["labels"][LABEL_CLOUD]
        for entry in r["inputs"]["spec"]["resourceGroups"][0]["flavors"]:
            flavor = flavors[cloud][entry["name"]]
            gpus = next(int(x["nominalQuota"]) for x in entry["resources"] if x["name"] == queues.GPU)
            granted[(cloud, flavor.model)] = granted.get((cloud, flavor.model), 0) + gpus
            hourly += gpus * flavor.gpu_hourly_usd
    rows = [{"cloud": c, "model": m, "used": granted.get((c, m), 0), "granted": g}
            for c, quota in sorted(team.gpus.items()) for m, g in sorted(quota.items())]
    violations = [{"policy": "team-gpu-quota", "enforcement": "mandatory", "resource": team.name, "team": team.name,
                   "message": f"team {team.name}: its queues grant {row['used']} {row['model']} GPUs on {row['cloud']}, "
                              f"not the {row['granted']} of teams.yaml"}
                  for row in rows if row["used"] != row["granted"]]
    return TeamReport(team.name, team.placement, plan["stack"], len(owned), round(hourly, 4),
                      round(hourly * cat.HOURS_PER_MONTH, 2), team.monthly_budget_usd, rows, violations)


def org_totals(reg: Registry, reports: list[TeamReport], shared_plan: dict[str, Any] | None) -> dict[str, Any]:
    """The org against its limits: every isolated team stack and the shared stack (whose pools
    hold the shared teams' quotas), cost at rest and GPUs at their max per cloud and model."""
    monthly = sum(r.monthly_usd for r in reports if r.placement == "isolated")
    gpus: dict[tuple[str, str], int] = {}
    if shared_plan is not None:
        monthly += shared_plan["cost"]["monthly_usd"]
        gpus = dict(gpu_usage(shared_plan))
    for r in reports:
        for row in r.gpus if r.placement == "isolated" else []:
            key = (row["cloud"], row["model"])
            gpus[key] = gpus.get(key, 0) + row["used"]
    rows: list[dict[str, Any]] = [{"cloud": c, "model": m, "used": n, "limit": quota_of(reg.org.gpus, c).get(m, 0)}
                                  for (c, m), n in sorted(gpus.items())]
    breaches = [f"org: {row['used']} {row['model']} GPUs on {row['cloud']} over the org's {row['limit']} "
                "(teams.yaml org.gpus)" for row in rows if row["used"] > row["limit"]]
    if monthly > reg.org.monthly_budget_usd:
        breaches.append(f"org: the stacks cost ${monthly:,.0f}/month, over the org's budget of "
                        f"${reg.org.monthly_budget_usd:,.0f} (teams.yaml org.monthlyBudgetUsd)")
    return {"monthly_usd": round(monthly, 2), "budget_usd": reg.org.monthly_budget_usd, "gpus": rows,
            "breaches": breaches}


def build(reg: Registry, root: Path, only: str | None = None) -> dict[str, Any]:
    """Every team's report (or one's) and, for all of them, the org's totals."""

    teams = [reg.team(only)] if only else reg.teams
    shared_plan = None
    if reg.org.shared_stack and (not only or any(t.placement == "shared" for t in teams)):
        shared_plan = build_plan(reg.org.shared_stack)
        stack = load_stack(reg.org.shared_stack, root)
        flavors: dict[str, dict[str, queues.Flavor]] = {c: queues.flavors(stack, c) for c in stack.spec.clouds}
    reports = []
    for team in teams:
        if team.placement == "isolated":
            reports.append(isolated(team, build_plan(team.stack_name)))
        else:
            assert shared_plan is not None  # the registry requires org.sharedStack with shared teams
            reports.append(shared(team, shared_plan, flavors))
    out: dict[str, Any] = {"teams": [{**asdict(r), "breached": r.breached} for r in reports]}
    if not only:
        out["org"] = org_totals(reg, reports, shared_plan)
        if shared_plan is not None:
            out["org"]["shared_stack"] = {"stack": shared_plan["stack"], "monthly_usd": shared_plan["cost"]["monthly_usd"],
                                          "violations": shared_plan["violations"]}
    return out


def _gpus(rows: list[dict[str, Any]], limit_key: str) -> str:
    return ", ".join(f"{r['cloud']} {r['model']} {r['used']}/{r[limit_key]}" + (" OVER" if r["used"] > r[limit_key] else "")
                     for r in rows) or "-"


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title="teams (isolated: the team's stack at rest; shared: its whole quota busy)")
    for col in ("team", "placement", "stack", "resources", "$/h", "$/month", "budget", "GPUs used/granted",
                "violations"):
        table.add_column(col, justify="right" if col in ("resources", "$/h", "$/month", "budget") else "left")
    for t in report["teams"]:
        mandatory = sum(v["enforcement"] == "mandatory" for v in t["violations"])
        table.add_row(t["team"], t["placement"], t["stack"], str(t["resources"]), f"{t['hourly_usd']:,.2f}",
                      f"{t['monthly_usd']:,.0f}", f"{t['budget_usd']:,.0f}", _gpus(t["gpus"], "granted"),
                      f"{mandatory} mandatory, {len(t['violations']) - mandatory} advisory")
    console.print(table)
    for t in report["teams"]:
        for v in t["violations"]:
            console.print(f"  [{'red' if v['enforcement'] == 'mandatory' else 'yellow'}]{v['enforcement']}[/] "
                          f"team {escape(t['team'])} [{escape(v['policy'])}] {escape(v['resource'])}: "
                          f"{escape(v['message'])}", highlight=False)
    org = report.get("org")
    if org:
        console.print(f"org: ${org['monthly_usd']:,.0f}/month of ${org['budget_usd']:,.0f} "
                      f"(isolated team stacks + the shared stack); GPUs {_gpus(org['gpus'], 'limit')}",
                      highlight=False)
        for line in org["breaches"]:
            console.print(f"  [red]breach[/] {escape(line)}", highlight=False)


def exit_code(report: dict[str, Any]) -> int:
    breached = any(t["breached"] for t in report["teams"]) or bool(report.get("org", {}).get("breaches"))
    return 1 if breached else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make teams", description=__doc__.split("\n\n")[0])
    parser.add_argument("--team", help="one team (default: all, with the org's totals)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 2 if the generated stacks differ")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an internal error")
    args = parser.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)
    root = project_root()
    try:
        reg = registry.load(root)
        for why in registry.unreadable_stacks(root):
            err.print(f"[yellow]warning:[/] {escape(why)} (make teams goes on without it: its bucket prefix is not "
                      "checked against the teams')", highlight=False)
        if args.team and args.team not in {t.name for t in reg.teams}:
            from infra.core.errors import suggest

            names = [t.name for t in reg.teams]
            err.print(f"[bold red]error:[/] TEAM={escape(args.team)}: no such team in teams.yaml"
                      f"{escape(suggest(args.team, names))} (teams: {', '.join(names)})", highlight=False)
            return 2
        if args.check:
            drift = generate.drift(reg, root)
            if drift:
                err.print("[bold red]error:[/] " + "; ".join(drift) + ": run `make teams` and commit the files",
                          highlight=False)
                return 2
        else:
            written, removed = generate.write(reg, root)
            for path in written:
                err.print(f"wrote {path.name} (from teams.yaml)", highlight=False)
            for path in removed:
                err.print(f"removed {path.name} (its team left teams.yaml)", highlight=False)
        report = build(reg, root, args.team)
    except (RegistryError, SpecError, StackFileError, CatalogError, pulumi.RunError, InputError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except Exception as exc:  # noqa: BLE001 (a bug here, not the registry's: exit 3, one line, as make plan)
        from infra.plan.__main__ import internal_error

        return internal_error(exc, args.debug, err)
    if args.format == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print_report(report, Console(width=None if sys.stdout.isatty() else 200))
    return exit_code(report)


if __name__ == "__main__":
    code = main()
    asyncio.get_event_loop().close()  # the mock engine's loop (as make plan does)
    sys.exit(code)
