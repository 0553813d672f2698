"""How a node group becomes managed node pools."""

from __future__ import annotations

from dataclasses import dataclass

from infra.model.spec import NodeGroup


@dataclass(frozen=True)
class PoolPart:
    """One managed node pool of a node group: EKS node groups and TKE node pools buy a single
    way, so a spot group's on-demand base becomes a pool of its own (ACK pools take an
    on-demand base natively and use one part)."""

    suffix: str  # od | spot
    spot: bool
    min: int
    max: int
    desired: int


def pool_parts(group: NodeGroup) -> list[PoolPart]:
    s = group.scaling
    if not group.market.spot:
        return [PoolPart("od", False, s.min, s.max, s.baseline)]
    base = group.market.on_demand_base
    parts = [PoolPart("od", False, base, base, base)] if base else []
    return parts + [PoolPart("spot", True, max(0, s.min - base), max(1, s.max - base), max(0, s.baseline - base))]


