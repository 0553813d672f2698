"""`make prices [CLOUD=aws|alicloud|tencentcloud] [REGION=<region>] [ACCEPT=1]`: refresh
infra/data/prices.csv from the clouds' own price sources (infra/prices/sources.py).

Every price row of the chosen clouds is asked for again (REGION adds that region for every type
of the cloud); the specs (gpu_catalog.csv) are never touched. What changed is printed — type,
region, old -> new, % — and a change larger than the threshold (25 % by default) is refused
unless --accept: a price list that moved that much deserves a look before every plan uses it.
Written rows carry their source and date (AWS: the offer file's version and publication date;
Alibaba and Tencent: the API and today) and are no longer estimates; the policy pack's copy
(policies/data/prices.csv) is written too. Exit 0 written (or nothing changed), 1 refused, 2 a
source failed or bad input.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra import clouds
from infra.core import catalog as cat
from infra.prices.sources import Live, PriceSourceError, Recorded, Source
from policies.gts_policy.catalog import PRICE_COLUMNS, Price

PRICES = cat.DATA_DIR / "prices.csv"
PACK_COPY = Path(__file__).resolve().parents[2] / "policies" / "data" / "prices.csv"
THRESHOLD_PCT = 25.0


@dataclass(frozen=True)
class Change:
    cloud: str
    instance_type: str
    region: str
    old: float | None  # None: a new row
    new: float
    currency: str
    reference: float  # the row's old price, or (a new row) the type's reference price in another region

    @property
    def pct(self) -> float:
        return 100 * (self.new - self.reference) / self.reference


def read(path: Path) -> tuple[str, list[Price]]:
    """(the comment header, the rows) of prices.csv, checked by the catalog's own reader."""
    from policies.gts_policy.catalog import load_prices_file

    header = "".join(line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.startswith("#"))
    return header, list(load_prices_file(path).values())


def render(header: str, rows: list[Price]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(PRICE_COLUMNS)
    for p in rows:
        writer.writerow([p.cloud, p.instance_type, p.region, f"{p.on_demand:.10g}", p.currency, f"{p.reserved_discount:.2f}",
                         p.source, p.date, str(p.estimate).lower(), f"{p.spot_discount:.2f}", p.spot_band, p.spot_source,
                         p.spot_date])
    return header + buf.getvalue()


def targets(rows: list[Price], clouds: list[str], regions: list[str]) -> list[Price]:
    """The rows to ask for: every row of `clouds`, plus a new row (from the type's reference row)
    in each of `regions` where a type has none."""
    chosen = [p for p in rows if p.cloud in clouds]
    have = {(p.cloud, p.instance_type, p.region) for p in rows}
    for cloud in clouds:
        first: dict[str, Price] = {}
        for p in rows:
            if p.cloud == cloud:
                first.setdefault(p.instance_type, p)
        for region in regions:
            # the reference row's spot discount as a start, not its band (the band is per region)
            chosen += [replace(ref, region=region, estimate=True, source="(new)", spot_band="",
                               spot_source=f"catalog estimate (as in {ref.region})")
                       for t, ref in first.items() if (cloud, t, region) not in have]
    return chosen


Refresh = Callable[[list[Price], Source, str, str], tuple[list[Price], list[str]]]


def refresher(cloud: str) -> Refresh:
    """The cloud's price source (infra/clouds/<cloud>/prices.py refresh, named by its profile)."""
    module, _, name = clouds.profile(cloud).price_refresh.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]



def merge(rows: list[Price], fresh: list[Price]) -> tuple[list[Price], list[Change]]:
    """The rows with the fresh ones in place (a new region after its type's last row), and the
    price changes."""
    def key(p: Price) -> tuple[str, str, str]:
        return p.cloud, p.instance_type, p.region

    by_key = {key(p): p for p in fresh}
    old = {key(p): p for p in rows}
    reference: dict[tuple[str, str], float] = {}
    for p in rows:
        reference.setdefault((p.cloud, p.instance_type), p.on_demand)
    changes = [Change(*k, old[k].on_demand if k in old else None, p.on_demand, p.currency,
                      old[k].on_demand if k in old else reference[k[:2]])
               for k, p in by_key.items() if k not in old or old[k].on_demand != p.on_demand]
    last = {(p.cloud, p.instance_type): i for i, p in enumerate(rows)}
    merged = []
    for i, p in enumerate(rows):
        merged.append(by_key.get(key(p), p))
        if last[(p.cloud, p.instance_type)] == i:
            merged += [n for k, n in by_key.items() if k not in old and k[:2] == (p.cloud, p.instance_type)]
    return merged, changes


def show(changes: list[Change], missing: list[str], threshold: float, console: Console) -> None:
    table = Table(title=f"price changes (USD or CNY per node-hour; over {threshold:g} % needs --accept)")
    for col in ("cloud", "type", "region", "old", "new", "%"):
        table.add_column(col, justify="right" if col in ("old", "new", "%") else "left")
    for c in changes:
        pct = f"{c.pct:+.1f}" + (" (new; vs the reference region)" if c.old is None else "")
        flag = " [red]over[/]" if abs(c.pct) > threshold else ""
        table.add_row(c.cloud, c.instance_type, c.region, "-" if c.old is None else f"{c.old:.10g}",
                      f"{c.new:.10g} {c.currency}", pct + flag)
    console.print(table if changes else "no price changed")
    for line in missing:
        console.print(f"[yellow]skipped[/] {escape(line)}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make prices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cloud", action="append", choices=cat.CLOUDS, help="one cloud (repeatable; default all)")
    parser.add_argument("--region", action="append", default=[], help="also price every type of the cloud here")
    parser.add_argument("--accept", action="store_true", help="write changes above the threshold too")
    parser.add_argument("--threshold", type=float, default=THRESHOLD_PCT, help="percent (default 25)")
    parser.add_argument("--site", choices=("china", "international"), default="china",
                        help="Tencent Cloud account site: its prices are in CNY (china) or USD (international)")
    parser.add_argument("--recorded", type=Path, help="read recorded responses from this folder instead of the clouds")
    parser.add_argument("--file", type=Path, default=PRICES, help="the prices file (default infra/data/prices.csv)")
    parser.add_argument("--today", default=datetime.date.today().isoformat(), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    err = Console(soft_wrap=True, stderr=True)  # errors and refusals on stderr, as every command's
    clouds = args.cloud or list(cat.CLOUDS)
    source: Source = Recorded(args.recorded) if args.recorded else Live()
    try:
        if args.threshold <= 0:
            raise PriceSourceError(f"--threshold {args.threshold:g}: use a percentage above 0")
        if args.region and len(clouds) != 1:
            raise PriceSourceError("REGION needs one CLOUD (the region names differ per cloud)")
        for region in args.region:
            if region not in cat.load_regions()[clouds[0]]:
                raise PriceSourceError(f"REGION={region} is not a {clouds[0]} region known here (infra/data/regions.yaml)")
        header, rows = read(args.file)
        asked = targets(rows, clouds, args.region)
        fresh: list[Price] = []
        missing: list[str] = []
        for cloud in clouds:
            mine = [p for p in asked if p.cloud == cloud]
            got, skipped = refresher(cloud)(mine, source.for_cloud(cloud), args.today, args.site)
            fresh += got
            missing += skipped
    except (PriceSourceError, OSError, cat.CatalogError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    merged, changes = merge(rows, fresh)
    show(changes, missing, args.threshold, console)
    big = [c for c in changes if abs(c.pct) > args.threshold]
    if big and not args.accept:
        err.print(f"[bold red]refused:[/] {len(big)} price(s) moved more than {args.threshold:g} %; check them, "
                      "then run again with ACCEPT=1 (nothing was written)", highlight=False)
        return 1
    try:
        write(args.file, render(header, merged))
    except cat.CatalogError as exc:
        err.print(f"[bold red]error:[/] the refreshed prices do not pass the catalog's checks, nothing written: "
                      f"{escape(str(exc))}", highlight=False)
        return 2
    console.print(f"wrote {args.file} ({len(changes)} price change(s))", highlight=False)
    return 0


def write(path: Path, text: str) -> None:
    """Check the new file with the catalog's own reader, then replace it (and the policy pack's
    copy, for the project's file) in one rename each: never a half-written or unloadable file."""
    from policies.gts_policy.catalog import load_prices_file

    targets_ = [path] + ([PACK_COPY] if path.resolve() == PRICES.resolve() else [])
    staged = []
    try:
        for target in targets_:
            temp = target.with_name(f".{target.name}.new")
            temp.write_text(text, encoding="utf-8")
            staged.append((temp, target))
            load_prices_file(temp)
        for temp, target in staged:
            os.replace(temp, target)
    finally:
        for temp, _ in staged:
            temp.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
