"""The GPU instance catalog (data/gpu_catalog.csv), region list and the instance selector.

The catalog is data: one CSV with a schema version, read and checked here. The selector
picks the cheapest instance types that meet a GPU requirement under the hardware rules the
guide asks for (host RAM >= 1.5 x total GPU memory; local NVMe >= the scratch asked for, or a
data disk of that size priced in).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The row model and reader are the policy pack's (it must run without this project); the data
# here is the source its copy is checked against.
from policies.gts_policy import catalog as pack
from policies.gts_policy.catalog import Catalog as Catalog
from policies.gts_policy.catalog import CatalogError as CatalogError
from policies.gts_policy.catalog import InstanceType as InstanceType
from policies.gts_policy.catalog import load_catalog_file as load_catalog_file
from policies.gts_policy.catalog import to_usd as to_usd

SCHEMA_VERSION = pack.SCHEMA_VERSION
CLOUDS = pack.CLOUDS
CLOUD_NAMES = pack.CLOUD_NAMES
RAM_PER_VRAM = pack.RAM_PER_VRAM
HOURS_PER_MONTH = pack.HOURS_PER_MONTH

DATA_DIR = Path(__file__).parents[1] / "data"
CATALOG_PATH = DATA_DIR / "gpu_catalog.csv"
@functools.cache
def load_catalog() -> Catalog:
    return load_catalog_file(CATALOG_PATH)


def load_yaml(name: str) -> dict[str, Any]:
    """infra/data/<name>, checked for its schema version; parsed once per process, a fresh copy
    per call (callers may change what they get)."""
    return copy.deepcopy(_parsed(name))


@functools.cache
def _parsed(name: str) -> dict[str, Any]:
    data = yaml.load((DATA_DIR / name).read_text(encoding="utf-8"),  # noqa: S506 (a safe loader)
                     Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
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


def _per_cloud(name: str) -> dict[str, dict[str, Any]]:
    """A data file keyed by cloud (every cloud present)."""
    data = load_yaml(name)
    return {cloud: dict(data[cloud]) for cloud in CLOUDS}


@functools.cache
def load_network_prices() -> dict[str, dict[str, Any]]:
    """What one network's NAT egress costs per hour on each cloud."""
    return _per_cloud("network_prices.yaml")


@functools.cache
def load_system_pools() -> dict[str, dict[str, Any]]:
    """The untainted system pool (and control-plane fee) of each cloud's clusters."""
    return _per_cloud("system_pools.yaml")


@functools.cache
def load_rendezvous() -> dict[str, dict[str, Any]]:
    """The rendezvous store instance of each cloud (type and price)."""
    return _per_cloud("rendezvous.yaml")


@functools.cache
def load_registry_prices() -> dict[str, dict[str, Any]]:
    """What the trainer image's registry costs per month on each cloud."""
    return _per_cloud("registry_prices.yaml")


@functools.cache
def load_storage_prices() -> dict[str, dict[str, Any]]:
    """Object storage, data disk and shared file system prices of each cloud."""
    return _per_cloud("storage_prices.yaml")


@functools.cache
def load_interruptions() -> dict[str, Any]:
    """Reclaim rates and notices per cloud and market (infra/data/interruptions.yaml; estimates)."""
    return load_yaml("interruptions.yaml")


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


def near_misses(catalog: Catalog, cloud: str, req: Requirement) -> str:
    """For a requirement no type meets: the types with its GPU model and what each lacks, the ones
    a change of `count` alone would make fit first (g5.xlarge's 16 GiB of RAM is under 1.5 x its
    A10G's 24 GB; g5.12xlarge would do with count: 4). '' when the cloud has no such GPU."""
    missed = []
    for item in catalog.of_cloud(cloud):
        if req.gpu_model is not None and item.gpu_model.lower() != req.gpu_model.lower():
            continue
        lacks = [f"{item.gpu_count} GPUs, not {req.gpu_count}"] if item.gpu_count != req.gpu_count else []
        if item.gpu_vram_gb < req.min_vram_gb:
            lacks.append(f"{item.gpu_vram_gb} GB per GPU")
        if not item.ram_ok:
            lacks.append(f"{item.ram_gib:g} GiB RAM, under {RAM_PER_VRAM:g} x {item.total_vram_gb} GB of GPU memory")
        if scratch_disk_gb(item, req.scratch_gb, req.scratch_source) is None:
            lacks.append(f"no room for {req.scratch_gb} GB of scratch ({req.scratch_source})")
        fix = f" — would do with count: {item.gpu_count}" if lacks and lacks[0].endswith(
            f"not {req.gpu_count}") and len(lacks) == 1 else ""
        missed.append((len(lacks) - bool(fix), f"{item.instance_type} ({'; '.join(lacks)}{fix})"))
    return "; near misses: " + ", ".join(text for _, text in sorted(missed)[:4]) if missed else ""


def roomier(catalog: Catalog, item: InstanceType) -> str:
    """The types with the same GPU whose host RAM meets the rule, for a type that does not: ''
    when there is none (then a gpu requirement on another model)."""
    fit = [f"{t.instance_type} ({t.gpu_count} x {t.gpu_model}, {t.ram_gib:g} GiB)" for t in catalog.of_cloud(item.cloud)
           if t.gpu_model == item.gpu_model and t.ram_ok]
    return f" such as {', '.join(fit)}" if fit else ""


def select(catalog: Catalog, clouds: Iterable[str], req: Requirement,
           cny_per_usd: float, region: str | None = None) -> list[Candidate]:
    """Every type on `clouds` that meets `req`, cheapest first (node price + scratch disk), at
    its price in `region` (types without one there are left out), or at its reference price."""
    found: list[Candidate] = []
    for cloud in clouds:
        for spec_item in catalog.of_cloud(cloud):
            item = catalog.priced(cloud, spec_item.instance_type, region) if region else spec_item
            if item is None or not meets(item, req):
                continue
            disk = scratch_disk_gb(item, req.scratch_gb, req.scratch_source) or 0
            hourly = to_usd(item.price_ondemand, item.currency, cny_per_usd)
            hourly += data_disk_hourly_usd(cloud, disk, cny_per_usd)
            found.append(Candidate(item, round(hourly, 6), disk))
    return sorted(found, key=lambda c: (c.hourly_usd, c.type.cloud, c.type.instance_type))
