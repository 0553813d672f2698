"""The GPU instance catalog (data/gpu_catalog.csv), region list and the instance selector.

The catalog is data: one CSV with a schema version, read and checked here. The selector
picks the cheapest instance types that meet a GPU requirement under the hardware rules the
guide asks for (host RAM >= 1.5 x total GPU memory; local NVMe >= the scratch asked for, or a
data disk of that size priced in).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.errors import CatalogError

DATA_DIR = Path(__file__).parent / "data"
CATALOG_PATH = DATA_DIR / "gpu_catalog.csv"
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


@functools.cache
def load_catalog() -> Catalog:
    return load_catalog_file(CATALOG_PATH)


def load_yaml(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DATA_DIR / name).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("schemaVersion") != SCHEMA_VERSION:
        raise CatalogError(f"{name}: expected a mapping with schemaVersion: {SCHEMA_VERSION}")
    return data


@functools.cache
def load_regions() -> dict[str, dict[str, list[str]]]:
    """cloud -> region -> zones."""
    data = load_yaml("regions.yaml")
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@functools.cache
def load_capabilities() -> dict[str, Any]:
    return load_yaml("capabilities.yaml")


def market_unavailable(cloud: str, site: str, market: str) -> str | None:
    """Why an account on `site` cannot buy `market` instances on `cloud`, or None."""
    reasons = load_capabilities().get("markets", {}).get(cloud, {}).get(site, {})
    reason = reasons.get(market)
    return str(reason) if reason else None


def vm_gpu_unsupported(cloud: str, gpu_model: str) -> str | None:
    """Why a VM group on `cloud` cannot run `gpu_model` GPUs (its image's driver), or None."""
    reason = load_capabilities().get("vmGpuModels", {}).get(cloud, {}).get(gpu_model)
    return str(reason) if reason else None


def feature_unavailable(cloud: str, feature: str) -> str | None:
    """Why this stack does not build `feature` on `cloud`, or None when it does."""
    reason = load_capabilities().get("features", {}).get(cloud, {}).get(feature)
    return str(reason) if reason else None


@functools.cache
def load_constraints() -> dict[str, Any]:
    """Provider limits the spec checks, each with its source (data/constraints.yaml)."""
    return load_yaml("constraints.yaml")


@functools.cache
def load_provider_checks() -> dict[str, dict[str, Any]]:
    """Per resource type: what was read against the provider's docs and source, and where."""
    return dict(load_yaml("provider_checks.yaml")["types"])


@functools.cache
def load_network_prices() -> dict[str, dict[str, Any]]:
    """What one network's NAT egress costs per hour on each cloud."""
    data = load_yaml("network_prices.yaml")
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@functools.cache
def load_system_pools() -> dict[str, dict[str, Any]]:
    """The untainted system pool (and control-plane fee) of each cloud's clusters."""
    data = load_yaml("system_pools.yaml")
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@functools.cache
def load_rendezvous() -> dict[str, dict[str, Any]]:
    """The rendezvous store instance of each cloud (type and price)."""
    data = load_yaml("rendezvous.yaml")
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@functools.cache
def load_registry_prices() -> dict[str, dict[str, Any]]:
    """What the trainer image's registry costs per month on each cloud."""
    data = load_yaml("registry_prices.yaml")
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@functools.cache
def load_storage_prices() -> dict[str, dict[str, Any]]:
    data = load_yaml("storage_prices.yaml")
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@dataclass(frozen=True)
class Requirement:
    """What a node group asks for instead of an instance type."""

    gpu_count: int = 1
    gpu_model: str | None = None
    min_vram_gb: int = 0
    scratch_gb: int = 0
    scratch_source: str = "auto"  # auto | instance-store | data-disk


@dataclass(frozen=True)
class Candidate:
    """An instance type that meets a requirement, with what it costs per node-hour in USD."""

    type: InstanceType
    hourly_usd: float  # on-demand node price plus any data disk for scratch
    data_disk_gb: int  # 0 when local NVMe holds the scratch


def to_usd(amount: float, currency: str, cny_per_usd: float) -> float:
    return amount if currency == "USD" else amount / cny_per_usd


def data_disk_hourly_usd(cloud: str, size_gb: int, cny_per_usd: float) -> float:
    prices = load_storage_prices()[cloud]
    monthly = size_gb * float(prices["dataDisk"])
    return to_usd(monthly, str(prices["currency"]), cny_per_usd) / HOURS_PER_MONTH


def scratch_disk_gb(item: InstanceType, scratch_gb: int, source: str) -> int | None:
    """Size of the data disk a node needs for its scratch; None when the source rules it out."""
    if scratch_gb <= 0:
        return 0
    if source == "instance-store":
        return 0 if item.nvme_gb >= scratch_gb else None
    if source == "data-disk":
        return scratch_gb
    return 0 if item.nvme_gb >= scratch_gb else scratch_gb


def meets(item: InstanceType, req: Requirement) -> bool:
    """Whether a type meets a requirement (GPU count and model, VRAM, RAM rule, scratch)."""
    return (
        item.gpu_count == req.gpu_count
        and (req.gpu_model is None or item.gpu_model.lower() == req.gpu_model.lower())
        and item.gpu_vram_gb >= req.min_vram_gb
        and item.ram_ok
        and scratch_disk_gb(item, req.scratch_gb, req.scratch_source) is not None
    )


def select(catalog: Catalog, clouds: Iterable[str], req: Requirement,
           cny_per_usd: float) -> list[Candidate]:
    """Every type on `clouds` that meets `req`, cheapest first (node price + scratch disk)."""
    found: list[Candidate] = []
    for cloud in clouds:
        for item in catalog.of_cloud(cloud):
            if not meets(item, req):
                continue
            disk = scratch_disk_gb(item, req.scratch_gb, req.scratch_source) or 0
            hourly = to_usd(item.price_ondemand, item.currency, cny_per_usd)
            hourly += data_disk_hourly_usd(cloud, disk, cny_per_usd)
            found.append(Candidate(item, round(hourly, 6), disk))
    return sorted(found, key=lambda c: (c.hourly_usd, c.type.cloud, c.type.instance_type))
