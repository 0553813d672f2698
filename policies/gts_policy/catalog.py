"""The GPU instance catalog (data/gpu_catalog.csv): the row model, the CSV reader with its
checks, and the currency rule. The policy pack reads its own copy of the data
(policies/data/, kept equal to infra/data/ by a test); the stack program reuses this code
(infra/catalog.py) on infra/data/."""

from __future__ import annotations

import csv
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


class CatalogError(Exception):
    """A data file shipped with the project (catalog, regions, prices) is malformed."""


SCHEMA_VERSION = 1
CLOUDS = ("aws", "alicloud", "tencentcloud")
CLOUD_NAMES = {"aws": "AWS", "alicloud": "Alibaba Cloud", "tencentcloud": "Tencent Cloud"}
RAM_PER_VRAM = 1.5
HOURS_PER_MONTH = 730.0

COLUMNS = (
    "cloud", "instance_type", "family", "gpu_model", "gpu_count", "gpu_vram_gb", "vcpu",
    "ram_gib", "nvme_gb", "nvswitch", "gpu_class", "price_ondemand", "currency",
    "price_region", "price_source", "price_date", "price_estimate", "spot_discount",
    "reserved_discount", "notes",
)


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


def _parse_row(row: Mapping[str, str], where: str) -> InstanceType:
    try:
        item = InstanceType(
            cloud=row["cloud"],
            instance_type=row["instance_type"],
            family=row["family"],
            gpu_model=row["gpu_model"],
            gpu_count=int(row["gpu_count"]),
            gpu_vram_gb=int(row["gpu_vram_gb"]),
            vcpu=int(row["vcpu"]),
            ram_gib=int(row["ram_gib"]),
            nvme_gb=int(row["nvme_gb"]),
            nvswitch=_parse_bool(row["nvswitch"], where),
            gpu_class=row["gpu_class"],
            price_ondemand=float(row["price_ondemand"]),
            currency=row["currency"],
            price_region=row["price_region"],
            price_source=row["price_source"],
            price_date=row["price_date"],
            price_estimate=_parse_bool(row["price_estimate"], where),
            spot_discount=float(row["spot_discount"]),
            reserved_discount=float(row["reserved_discount"]),
            notes=row.get("notes") or "",
        )
    except ValueError as exc:
        raise CatalogError(f"{where}: {exc}") from exc
    if item.cloud not in CLOUDS:
        raise CatalogError(f"{where}: unknown cloud {item.cloud!r}")
    if item.currency not in ("USD", "CNY"):
        raise CatalogError(f"{where}: currency must be USD or CNY, got {item.currency!r}")
    if item.gpu_class not in ("training", "inference"):
        raise CatalogError(f"{where}: gpu_class must be training or inference")
    if item.gpu_count < 1 or item.gpu_vram_gb < 1 or item.price_ondemand <= 0:
        raise CatalogError(f"{where}: gpu_count, gpu_vram_gb and price_ondemand must be positive")
    if not (0 <= item.spot_discount < 1 and 0 <= item.reserved_discount < 1):
        raise CatalogError(f"{where}: discounts are fractions in [0, 1)")
    return item


@dataclass(frozen=True)
class Catalog:
    """All instance types, keyed by (cloud, instance_type)."""

    types: Mapping[tuple[str, str], InstanceType]

    def get(self, cloud: str, instance_type: str) -> InstanceType | None:
        return self.types.get((cloud, instance_type))

    def of_cloud(self, cloud: str) -> list[InstanceType]:
        return [t for (c, _), t in self.types.items() if c == cloud]

    def gpu_models(self, cloud: str) -> list[str]:
        return sorted({t.gpu_model for t in self.of_cloud(cloud)})

    def with_prices(self, overrides: Mapping[tuple[str, str], float]) -> Catalog:
        """A copy with on-demand prices replaced (a stack's pricing.overrides)."""
        types = dict(self.types)
        for key, price in overrides.items():
            types[key] = dataclasses.replace(types[key], price_ondemand=price, price_source="stack override",
                                             price_estimate=False)
        return Catalog(types)


def load_catalog_file(path: Path) -> Catalog:
    """Read and check a catalog CSV: schema version header, exact columns, unique types."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].strip() != f"# schema_version={SCHEMA_VERSION}":
        raise CatalogError(f"{path.name}: first line must be '# schema_version={SCHEMA_VERSION}'")
    body = [(n, line) for n, line in enumerate(lines, start=1) if not line.startswith("#")]
    reader = csv.DictReader(line for _, line in body)
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise CatalogError(f"{path.name}: columns must be {','.join(COLUMNS)}; got {reader.fieldnames}")
    types: dict[tuple[str, str], InstanceType] = {}
    for (line_no, _), row in zip(body[1:], reader):
        item = _parse_row(row, f"{path.name}:{line_no}")
        key = (item.cloud, item.instance_type)
        if key in types:
            raise CatalogError(f"{path.name}:{line_no}: duplicate instance type {key}")
        types[key] = item
    return Catalog(types)


def to_usd(amount: float, currency: str, cny_per_usd: float) -> float:
    return amount if currency == "USD" else amount / cny_per_usd


@functools.cache
def pack_catalog() -> Catalog:
    """The pack's copy of the catalog."""
    return load_catalog_file(DATA_DIR / "gpu_catalog.csv")


@functools.cache
def pack_capabilities() -> dict[str, Any]:
    data = yaml.safe_load((DATA_DIR / "capabilities.yaml").read_text(encoding="utf-8"))
    return dict(data)
