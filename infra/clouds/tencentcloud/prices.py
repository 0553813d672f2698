"""Tencent Cloud's price source: CVM InquiryPriceRunInstances
(infra/clouds/tencentcloud/profile.py price_refresh; `make prices` runs it)."""

from __future__ import annotations

from dataclasses import replace

from infra.clouds.tencentcloud.profile import TencentcloudProfile
from infra.core import catalog as cat
from infra.prices.sources import Source, Unanswered, tencentcloud_price
from policies.gts_policy.catalog import Price

def refresh(rows: list[Price], source: Source, today: str, site: str) -> tuple[list[Price], list[str]]:
    """InquiryPriceRunInstances answers without a currency: the account's site decides it
    (--site: international bills USD, china CNY), and a row in the other currency is left alone."""
    currency = "USD" if site == "international" else "CNY"
    zones = cat.load_regions()[TencentcloudProfile.name]
    out, missing = [], []
    for p in rows:
        where = f"{TencentcloudProfile.name} {p.instance_type} {p.region}"
        if p.currency != currency:
            missing.append(f"{where}: the catalog row is in {p.currency}, this account's site bills {currency}; "
                           "not changed")
            continue
        if p.region not in zones:
            missing.append(f"{where}: no zones for the region in infra/data/regions.yaml; add them")
            continue
        try:
            price = tencentcloud_price(source.tencentcloud_inquiry(p.region, zones[p.region][0], p.instance_type))
        except Unanswered as exc:
            missing.append(f"{where}: {exc}")
            continue
        out.append(replace(p, on_demand=price, source="Tencent Cloud CVM InquiryPriceRunInstances (UnitPriceDiscount)",
                           date=today, estimate=False))
    return out, missing
