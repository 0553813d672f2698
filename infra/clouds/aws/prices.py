"""AWS's price source: the Price List bulk offer file and the Spot Instance Advisor data
(infra/clouds/aws/profile.py price_refresh; `make prices` runs it)."""

from __future__ import annotations

from dataclasses import replace

from infra.prices.sources import Source, Unanswered, aws_offer, aws_spot
from policies.gts_policy.catalog import Price

ADVISOR = "AWS Spot Instance Advisor data (spot-advisor-data.json)"


def refresh(rows: list[Price], source: Source, today: str, site: str) -> tuple[list[Price], list[str]]:
    """Fresh rows (on-demand, 1-year reserved, spot band) and what could not be asked."""
    out, missing = [], []
    advisor = source.aws_spot_advisor()
    for region in sorted({p.region for p in rows}):
        here = [p for p in rows if p.region == region]
        types = {p.instance_type for p in here}
        try:
            offer = aws_offer(source.aws_offer_lines(region), region, types)
        except Unanswered as exc:
            missing.append(f"aws {region}: {exc}")
            continue
        spot = aws_spot(advisor, region, types)
        for p in here:
            if p.instance_type not in offer.prices:
                missing.append(f"aws {p.instance_type} {region}: not in the offer file (not offered there)")
                continue
            on_demand = offer.prices[p.instance_type]
            reserved = offer.reserved.get(p.instance_type)
            fresh = replace(p, on_demand=on_demand, source=f"AWS Price List bulk offer AmazonEC2 {offer.version}",
                            date=offer.date, estimate=False,
                            reserved_discount=round(1 - reserved / on_demand, 2) if reserved else p.reserved_discount)
            if p.instance_type in spot:
                discount, band = spot[p.instance_type]
                if (discount, band) != (p.spot_discount, p.spot_band):
                    fresh = replace(fresh, spot_discount=discount, spot_band=band, spot_source=ADVISOR, spot_date=today)
            out.append(fresh)
    return out, missing
