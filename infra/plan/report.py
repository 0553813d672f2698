"""The plan as tables for people (rich)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Inputs worth a glance, in the order shown; the first ones found are printed.
KEY_INPUTS = (
    "region", "cidrBlock", "cidrBlock", "vpcCidr", "cidr", "availabilityZone", "zoneId", "zone",
    "availabilityZone", "instanceType", "instanceTypes", "instanceChargeType", "spotStrategy",
    "capacityType", "amiType", "minSize", "maxSize", "desiredCapacity", "desiredSize",
    "bucket", "limitAmount", "size", "volumeSize", "peerRegion",
)


def cloud_of(type_token: str) -> str:
    """aws for aws:ec2/vpc:Vpc, pulumi:providers:aws and gpu-training-stack:aws:Platform."""
    parts = type_token.split(":")
    if parts[0] == "pulumi":
        return parts[-1]
    return parts[1] if parts[0] == "gpu-training-stack" else parts[0]


def key_inputs(inputs: dict[str, Any], limit: int = 4) -> str:
    parts: list[str] = []
    for key in dict.fromkeys(KEY_INPUTS):
        if key in inputs and inputs[key] not in (None, "", [], {}):
            value = inputs[key]
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            parts.append(f"{key}={text}")
        if len(parts) == limit:
            break
    return " ".join(parts)


NARROW = 100  # columns: under this, each table keeps the columns that identify a row and its cost


def table(title: str, columns: tuple[str, ...], rows: Sequence[Sequence[str]], console: Console,
          narrow: tuple[str, ...] | None = None, left: tuple[str, ...] | None = None) -> Table:
    """A table of `columns`, only the `narrow` ones on a console under NARROW columns wide; the
    `left` columns aligned left and the others (figures) right (all left when not given)."""
    keep = [i for i, c in enumerate(columns) if narrow is None or console.width >= NARROW or c in narrow]
    out = Table(title=title)
    for i in keep:
        out.add_column(columns[i], overflow="fold", justify="left" if left is None or columns[i] in left else "right")
    for row in rows:
        out.add_row(*(row[i] for i in keep))
    return out


def width(isatty: bool, environ: dict[str, str]) -> int | None:
    """The table width: the terminal's (rich measures it), COLUMNS when set, else 180 for a pipe."""
    if isatty:
        return None
    columns = environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else 180


def print_plan(plan: dict[str, Any], console: Console) -> None:
    _resources(plan, console)
    _cost(plan["cost"], console)
    _violations(plan["violations"], console)


def _resources(plan: dict[str, Any], console: Console) -> None:
    rows = []
    for res in sorted(plan["resources"], key=lambda r: (cloud_of(r["type"]), r["type"], r["name"])):
        guard = ("protect+retain" if res.get("retainOnDelete") else "protect") if res.get("protect") else ""
        rows.append((cloud_of(res["type"]), res["type"], escape(res["name"]), guard, escape(key_inputs(res["inputs"]))))
    console.print(table(f"stack {plan['stack']}: {len(plan['resources'])} resources",
                        ("cloud", "type", "name", "protected", "key inputs"), rows, console,
                        narrow=("type", "name", "protected")))
    if "replacements" in plan:
        if plan["replacements"]:
            rt = Table(title="[bold red]stateful resources this change would replace or delete[/]")
            for column in ("resource", "why"):
                rt.add_column(column, overflow="fold")
            for r in plan["replacements"]:
                rt.add_row(escape(f"{r['type']} {r['name']}"), escape(r["why"]))
            console.print(rt)
        else:
            console.print("[green]no stateful resource is replaced or deleted by this change[/]")


def _cost(cost: dict[str, Any], console: Console) -> None:
    rows: list[tuple[str, ...]] = []
    for g in cost["node_groups"]:
        flag = "*" if g["price_estimate"] else ""
        cap = "" if g["spot_max_price"] is None else (
            f"{g['spot_max_price']:,.2f} {g['currency']}"
            + (" (on-demand)" if g["spot_max_price_basis"].startswith("on-demand") else ""))
        fabric = "" if g["fabric"] == "none" else (
            f"{g['fabric']} x{g['fabric_devices']} ({g['fabric_interfaces']} NICs), {g['placement']} "
            f"${g['placement_monthly_usd']:,.0f}")
        spare = "" if not g["spares"] else (f"{g['spares']}: ${g['spares_monthly_usd']:,.0f} "
                                            f"({g['losses_per_month']:.1f} losses/month)")
        rows.append((g["name"], g["cloud"], g["region"], g["instance_type"] + flag, g["market"], fabric, cap, spare,
                     f"{g['average_nodes']:.2f}", f"{g['hourly_usd']:,.2f}", f"{g['monthly_usd']:,.0f}",
                     f"{g['on_demand_monthly_usd']:,.0f}"))
    console.print(table("cost by node group (USD)", ("node group", "cloud", "region", "type", "market", "fabric",
                                                     "spot cap /node-h", "spares $/month", "avg nodes", "$/h", "$/month",
                                                     "on-demand $/month"), rows, console,
                        narrow=("node group", "type", "market", "$/month"),
                        left=("node group", "cloud", "region", "type", "market", "fabric", "spares $/month")))
    rows = []
    for name, c in cost["by_cloud"].items():
        rows.append((name, f"{c['hourly_usd']:,.2f}", f"{c['monthly_usd']:,.0f}", f"{c['storage_monthly_usd']:,.0f}",
                     f"{c['clusters_monthly_usd']:,.0f}", f"{c['nat_monthly_usd']:,.0f}",
                     f"{c['registry_monthly_usd']:,.0f}", f"{c['rendezvous_monthly_usd']:,.0f}",
                     f"{c['shared_fs_monthly_usd']:,.0f}", f"{c['peak_hourly_usd']:,.2f}",
                     f"{c['on_demand_monthly_usd']:,.0f}"))
    rows.append(("[bold]total[/]", f"{cost['hourly_usd']:,.2f}", f"{cost['monthly_usd']:,.0f}", "", "", "", "", "", "",
                 f"{cost['peak_hourly_usd']:,.2f}", f"{cost['on_demand_monthly_usd']:,.0f}"))
    console.print(table("cost by cloud (USD; node groups, object storage, clusters, NAT, image registry, rendezvous "
                        "stores, shared file systems)", ("cloud", "$/h", "$/month", "storage", "clusters", "NAT",
                                                          "registry", "rdzv", "shared FS", "peak $/h",
                                                          "on-demand $/month"), rows, console,
                        narrow=("cloud", "$/h", "$/month", "on-demand $/month"), left=("cloud",)))
    console.print(f"saving vs on-demand: {cost['savings_vs_on_demand_pct']}%   "
                  f"budget: ${cost['budget_monthly_usd']:,.0f}/month"
                  + ("   (* price is an estimate; override in pricing.overrides)" if cost["includes_estimates"] else ""))
    _places(cost.get("capacity_places") or [], console)
    prices = cost.get("prices")
    if prices and prices["oldest"]:
        oldest = prices["oldest"]
        age = (f"{prices['age_days']} days" if prices["age_days"] >= 0 else
               f"dated {-prices['age_days']} days after today: the clock or GTS_TODAY is behind")
        console.print(f"prices: each group's region (infra/data/prices.csv); oldest used {oldest['date']} "
                      f"({age}: {escape(oldest['type'])} in {oldest['region']}, "
                      f"{escape(str(oldest['source']))})", highlight=False)


def _places(places: list[dict[str, Any]], console: Console) -> None:
    """Each group's places (docs/capacity.md): worst case at its maximum size, and what a move copies."""
    if not places:
        return
    rows = [(p["group"], "declared" if p["index"] == 0 else f"capacity[{p['index'] - 1}]", p["place"] + (
        "*" if p["estimate"] else ""), f"{p['hourly_usd']:,.2f}", f"{p['move_gb']:,.0f}", f"{p['move_usd']:,.2f}")
            for p in places]
    console.print(table("capacity candidates (USD; worst case at the group's maximum size; a move copies the newest "
                        "checkpoint and the dataset)", ("node group", "place", "where", "max $/h", "move GB",
                                                        "move $"), rows, console, narrow=("node group", "max $/h"),
                        left=("node group", "place", "where")))


def _violations(violations: list[dict[str, str]], console: Console) -> None:
    if not violations:
        console.print("[green]policies: no violations[/]")
        return
    vt = Table(title="policy violations")
    for column in ("level", "policy", "resource", "message"):
        vt.add_column(column, overflow="fold")
    for v in violations:
        style = "red" if v["enforcement"] == "mandatory" else "yellow"
        vt.add_row(f"[{style}]{v['enforcement']}[/]", v["policy"], escape(v.get("resource", "")), escape(v["message"]))
    console.print(vt)
