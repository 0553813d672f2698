"""The GPU instance catalog (data/gpu_catalog.csv: the hardware of each type) and its prices
(data/prices.csv: per cloud, type and region, with source and date): the row model, the CSV
readers with their checks, and the currency rule. The policy pack reads its own copy of the data
(policies/data/, kept equal to infra/data/ by a test); the stack program reuses this code
(infra/core/catalog.py) on infra/data/."""

from __future__ import annotations

import csv
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import clouds as pack_clouds

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class CatalogError(Exception):
    """A data file shipped with the project (catalog, regions, prices) is malformed."""


SCHEMA_VERSION = 1  # the YAML data files
CATALOG_SCHEMA = 2  # gpu_catalog.csv: specs only since the prices moved to prices.csv
PRICES_SCHEMA = 1
CLOUDS = pack_clouds.CLOUDS  # the pack's one table of clouds (clouds.py)
CLOUD_NAMES = pack_clouds.CLOUD_NAMES
RAM_PER_VRAM = 1.5
HOURS_PER_MONTH = 730.0

COLUMNS = (
    "cloud", "instance_type", "family", "gpu_model", "gpu_count", "gpu_vram_gb", "vcpu",
    "ram_gib", "nvme_gb", "nvswitch", "gpu_class", "notes",
)
PRICE_COLUMNS = (
    "cloud", "instance_type", "region", "price_ondemand", "currency", "reserved_discount", "source", "date",
    "estimate", "spot_discount", "spot_band", "spot_source", "spot_date",
)
SPOT_BANDS = ("<5%", "5-10%", "10-15%", "15-20%", ">20%")  # the AWS Spot Instance Advisor's ranges


@dataclass(frozen=True)
class InstanceType:
    """One GPU instance type of one cloud, with its on-demand price in its own currency."""

    cloud: str
    instance_type: str
    family: str
    gpu_model: str
    gpu_count: int
    gpu_vram_gb: int  # per GPU
    vcpu: int
    ram_gib: int
    nvme_gb: int  # local instance-store NVMe, all disks together
    nvswitch: bool  # needs NVIDIA fabric manager
    gpu_class: str  # training | inference
    price_ondemand: float  # per node-hour, in `currency`
    currency: str
    price_region: str
    price_source: str
    price_date: str
    price_estimate: bool
    spot_discount: float  # typical spot discount off on-demand, 0..1
    reserved_discount: float  # typical 1-year reserved / prepaid discount, 0..1
    notes: str
    spot_band: str = ""  # AWS Spot Advisor interruption band in price_region, where published

    @property
    def total_vram_gb(self) -> int:
        return self.gpu_count * self.gpu_vram_gb

    @property
    def ram_ok(self) -> bool:
        """Host RAM is at least 1.5 x the total GPU memory."""
        return self.ram_gib >= RAM_PER_VRAM * self.total_vram_gb


def _parse_bool(text: str, where: str) -> bool:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise CatalogError(f"{where}: expected true or false, got {text!r}")


@dataclass(frozen=True)
class Price:
    """What one type costs in one region, and where that figure comes from."""

    cloud: str
    instance_type: str
    region: str
    on_demand: float  # per node-hour in `currency`
    currency: str
    reserved_discount: float
    source: str
    date: str  # YYYY-MM or YYYY-MM-DD
    estimate: bool
    spot_discount: float
    spot_band: str
    spot_source: str
    spot_date: str


def _parse_spec(row: Mapping[str, str], where: str) -> dict[str, Any]:
    try:
        spec: dict[str, Any] = dict(cloud=row["cloud"], instance_type=row["instance_type"], family=row["family"],
                    gpu_model=row["gpu_model"], gpu_count=int(row["gpu_count"]), gpu_vram_gb=int(row["gpu_vram_gb"]),
                    vcpu=int(row["vcpu"]), ram_gib=int(row["ram_gib"]), nvme_gb=int(row["nvme_gb"]),
                    nvswitch=_parse_bool(row["nvswitch"], where), gpu_class=row["gpu_class"],
                    notes=row.get("notes") or "")
    except ValueError as exc:
        raise CatalogError(f"{where}: {exc}") from exc
    if spec["cloud"] not in CLOUDS:
        raise CatalogError(f"{where}: unknown cloud {spec['cloud']!r}")
    if spec["gpu_class"] not in ("training", "inference"):
        raise CatalogError(f"{where}: gpu_class must be training or inference")
    if spec["gpu_count"] < 1 or spec["gpu_vram_gb"] < 1:
        raise CatalogError(f"{where}: gpu_count and gpu_vram_gb must be positive")
    return spec


def parse_price(row: Mapping[str, str], where: str) -> Price:
    try:
        price = Price(row["cloud"], row["instance_type"], row["region"], float(row["price_ondemand"]),
                      row["currency"], float(row["reserved_discount"]), row["source"], row["date"],
                      _parse_bool(row["estimate"], where), float(row["spot_discount"]), row["spot_band"],
                      row["spot_source"], row["spot_date"])
    except ValueError as exc:
        raise CatalogError(f"{where}: {exc}") from exc
    if price.currency not in ("USD", "CNY"):
        raise CatalogError(f"{where}: currency must be USD or CNY, got {price.currency!r}")
    if price.on_demand <= 0:
        raise CatalogError(f"{where}: price_ondemand must be positive")
    if not (0 <= price.spot_discount < 1 and 0 <= price.reserved_discount < 1):
        raise CatalogError(f"{where}: discounts are fractions in [0, 1)")
    if price.spot_band not in ("", *SPOT_BANDS):
        raise CatalogError(f"{where}: spot_band must be empty or one of {', '.join(SPOT_BANDS)}")
    for label, value in (("date", price.date), ("spot_date", price.spot_date)):
        if not _is_date(value):
            raise CatalogError(f"{where}: {label} must be YYYY-MM or YYYY-MM-DD, got {value!r}")
    return price


def _is_date(text: str) -> bool:
    import datetime

    for fmt in ("%Y-%m-%d", "%Y-%m"):
        try:
            datetime.datetime.strptime(text, fmt)
            return True
        except ValueError:
            continue
    return False


def priced(spec: Mapping[str, Any], price: Price) -> InstanceType:
    """A type's hardware with one region's price."""
    return InstanceType(**spec, price_ondemand=price.on_demand, currency=price.currency, price_region=price.region,
                        price_source=price.source, price_date=price.date, price_estimate=price.estimate,
                        spot_discount=price.spot_discount, reserved_discount=price.reserved_discount,
                        spot_band=price.spot_band)


@dataclass(frozen=True)
class Catalog:
    """All instance types, keyed by (cloud, instance_type), each at its reference price (its
    first row in prices.csv), and every price by (cloud, instance_type, region)."""

    types: Mapping[tuple[str, str], InstanceType]
    prices: Mapping[tuple[str, str, str], Price] = dataclasses.field(default_factory=dict)

    def get(self, cloud: str, instance_type: str) -> InstanceType | None:
        return self.types.get((cloud, instance_type))

    def priced(self, cloud: str, instance_type: str, region: str) -> InstanceType | None:
        """The type at its price in `region`; None where the type or that price is not here."""
        item, price = self.types.get((cloud, instance_type)), self.prices.get((cloud, instance_type, region))
        if item is None or price is None:
            return None
        return dataclasses.replace(item, price_ondemand=price.on_demand, currency=price.currency,
                                   price_region=price.region, price_source=price.source, price_date=price.date,
                                   price_estimate=price.estimate, spot_discount=price.spot_discount,
                                   reserved_discount=price.reserved_discount, spot_band=price.spot_band)

    def regions_of(self, cloud: str, instance_type: str) -> list[str]:
        return [r for (c, t, r) in self.prices if (c, t) == (cloud, instance_type)]

    def of_cloud(self, cloud: str) -> list[InstanceType]:
        return [t for (c, _), t in self.types.items() if c == cloud]

    def gpu_models(self, cloud: str) -> list[str]:
        return sorted({t.gpu_model for t in self.of_cloud(cloud)})

    def with_prices(self, overrides: Mapping[tuple[str, str, str | None], float]) -> Catalog:
        """A copy with on-demand prices replaced (a stack's pricing.overrides): in one region, or
        in every region priced here (and as the reference price) where the region is None."""
        types, prices = dict(self.types), dict(self.prices)
        for (cloud, itype, region), amount in overrides.items():
            keys = [k for k in prices if k[:2] == (cloud, itype) and region in (None, k[2])]
            if region is not None and not keys:
                base = next(p for k, p in prices.items() if k[:2] == (cloud, itype))
                prices[(cloud, itype, region)] = dataclasses.replace(  # the band is another region's: dropped
                    base, region=region, spot_band="", spot_source=f"catalog estimate (as in {base.region})")
                keys = [(cloud, itype, region)]
            for key in keys:
                prices[key] = dataclasses.replace(prices[key], on_demand=amount, source="stack override",
                                                  estimate=False)
            if region is None or types[(cloud, itype)].price_region == region:
                types[(cloud, itype)] = dataclasses.replace(types[(cloud, itype)], price_ondemand=amount,
                                                            price_source="stack override", price_estimate=False)
        return Catalog(types, prices)


def csv_rows(path: Path, schema: int, columns: tuple[str, ...]) -> list[tuple[str, dict[str, str]]]:
    """(where, row) of a data CSV whose first line is its schema version and whose header is
    exactly `columns` (the catalog, the prices and infra/data/fabric.csv)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].strip() != f"# schema_version={schema}":
        raise CatalogError(f"{path.name}: first line must be '# schema_version={schema}'")
    body = [(n, line) for n, line in enumerate(lines, start=1) if not line.startswith("#")]
    reader = csv.DictReader(line for _, line in body)
    if tuple(reader.fieldnames or ()) != columns:
        raise CatalogError(f"{path.name}: columns must be {','.join(columns)}; got {reader.fieldnames}")
    return [(f"{path.name}:{line_no}", row) for (line_no, _), row in zip(body[1:], reader)]


def load_prices_file(path: Path) -> dict[tuple[str, str, str], Price]:
    prices: dict[tuple[str, str, str], Price] = {}
    for where, row in csv_rows(path, PRICES_SCHEMA, PRICE_COLUMNS):
        price = parse_price(row, where)
        key = (price.cloud, price.instance_type, price.region)
        if key in prices:
            raise CatalogError(f"{where}: duplicate price {key}")
        prices[key] = price
    return prices


def load_catalog_file(path: Path, prices_path: Path | None = None) -> Catalog:
    """Read and check the catalog CSV and its prices (prices.csv next to it): schema versions,
    exact columns, unique types and prices, a price for every type and a type for every price."""
    specs: dict[tuple[str, str], dict[str, Any]] = {}
    for where, row in csv_rows(path, CATALOG_SCHEMA, COLUMNS):
        spec = _parse_spec(row, where)
        key = (spec["cloud"], spec["instance_type"])
        if key in specs:
            raise CatalogError(f"{where}: duplicate instance type {key}")
        specs[key] = spec
    prices_path = prices_path or path.parent / "prices.csv"
    prices = load_prices_file(prices_path)
    types: dict[tuple[str, str], InstanceType] = {}
    for (cloud, itype, _), price in prices.items():
        if (cloud, itype) not in specs:
            raise CatalogError(f"{prices_path.name}: {cloud} {itype} has a price but no row in {path.name}")
        types.setdefault((cloud, itype), priced(specs[(cloud, itype)], price))
    missing = sorted(set(specs) - set(types))
    if missing:
        raise CatalogError(f"{prices_path.name}: no price for {', '.join(f'{c} {t}' for c, t in missing)}")
    return Catalog({k: types[k] for k in specs}, prices)


def to_usd(amount: float, currency: str, cny_per_usd: float) -> float:
    return amount if currency == "USD" else amount / cny_per_usd


@functools.cache
def pack_catalog() -> Catalog:
    """The pack's copy of the catalog and its prices."""
    return load_catalog_file(DATA_DIR / "gpu_catalog.csv")


@functools.cache
def pack_capabilities() -> dict[str, Any]:
    data = yaml.safe_load((DATA_DIR / "capabilities.yaml").read_text(encoding="utf-8"))
    return dict(data)
