"""Alibaba Cloud's price source: ECS DescribePrice and DescribeSpotPriceHistory
(infra/clouds/alicloud/profile.py price_refresh; `make prices` runs it)."""

from __future__ import annotations

from dataclasses import replace

from infra.clouds.alicloud.profile import AlicloudProfile
from infra.core import catalog as cat
from infra.prices.sources import Source, Unanswered, alicloud_price, alicloud_spot
from policies.gts_policy.catalog import Price

ALIBABA_SPOT = "Alibaba Cloud ECS DescribeSpotPriceHistory (1 - mean SpotPrice / OriginPrice)"


def refresh(rows: list[Price], source: Source, today: str, site: str) -> tuple[list[Price], list[str]]:
    """Fresh rows (on-demand in the row's currency, spot discount) and what could not be asked."""
    out, missing = [], []
    for p in rows:
        try:
            price, currency = alicloud_price(source.alicloud_describe_price(p.region, p.instance_type))
        except Unanswered as exc:
            missing.append(f"alicloud {p.instance_type} {p.region}: {exc}")
            continue
        if currency != p.currency:
            missing.append(f"alicloud {p.instance_type} {p.region}: the API answers in {currency}, the catalog row is "
                           f"{p.currency} (an account of the other site); not changed")
            continue
        fresh = replace(p, on_demand=price, source="Alibaba Cloud ECS DescribePrice (TradePrice)", date=today,
                        estimate=False)
        zone = cat.load_regions()[AlicloudProfile.name].get(p.region, [""])[0]
        try:
            discount = alicloud_spot(source.alicloud_spot_history(p.region, zone, p.instance_type), p.instance_type)
            fresh = replace(fresh, spot_discount=discount, spot_source=ALIBABA_SPOT, spot_date=today)
        except Unanswered as exc:
            missing.append(f"alicloud {p.instance_type} {p.region} spot: {exc} (spot discount kept)")
        out.append(fresh)
    return out, missing
