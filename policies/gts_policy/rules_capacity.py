"""The pack's cap on a node group's capacity candidates (docs/capacity.md): the broker may move a
group only to places whose worst case — every node at the group's maximum size, in the
candidate's market — costs at most `maxRatio` (default 1.5) times the group's place as declared,
and to no on-demand nodes unless `allowOnDemand`. The rows come from the stack
(infra/capacity/pricing.py through infra/stack/policy_config.py, capacityPlaces)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .registry import stack_rule
from .resources import Res

DEFAULT_RATIO = 1.5
SCHEMA: dict[str, dict[str, Any]] = {"capacityPlaces": {"type": "array"}, "maxRatio": {"type": "number"},
                                     "allowOnDemand": {"type": "boolean"}}


@stack_rule("capacity-candidates-capped", "A node group's capacity candidates cost at most maxRatio (1.5) x its "
            "declared place at its maximum size, and buy no on-demand nodes unless allowOnDemand.", "mandatory", SCHEMA)
def candidates_capped(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    ratio = float(cfg.get("maxRatio", DEFAULT_RATIO))
    on_demand_ok = bool(cfg.get("allowOnDemand", False))
    out = []
    for row in cfg.get("capacityPlaces") or []:
        if int(row.get("index", 0)) == 0:
            continue
        name = f"{row['group']} capacity[{int(row['index']) - 1}]"
        # the worst case: spot at its cap, or at on-demand without one (a spot price is no ceiling)
        hourly, primary = float(row.get("worst_hourly_usd", row["hourly_usd"])), float(row["primaryHourlyUsd"])
        if primary > 0 and hourly > ratio * primary:
            out.append((name, f"{row['place']} can reach ${hourly:,.2f}/h at the group's maximum size (spot at its "
                              "cap, or at on-demand without one), over "
                              f"{ratio:g} x the declared place's ${primary:,.2f}/h (${ratio * primary:,.2f}/h): pick "
                              "cheaper types or a spot market there, or raise capacity-candidates-capped maxRatio"))
        if int(row.get("on_demand_nodes", 0)) > 0 and not on_demand_ok:
            out.append((name, f"{row['place']} buys {row['on_demand_nodes']} node(s) on-demand: use a spot market "
                              "there, or set capacity-candidates-capped allowOnDemand: true"))
    return out
