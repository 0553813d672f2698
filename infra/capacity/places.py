"""A node group's places, in order: where it is declared (0) and each `capacity` candidate (k),
resolved against the stack (cloud, region, network, types, market); and the spec with each
group at its `activeCandidate`, which is what the program builds and the plan prices."""

from __future__ import annotations

from dataclasses import dataclass

from infra import clouds, fabric as fab
from infra.model.spec import Market, Network, NodeGroup, StackSpec
from infra.resolve.groups import pick


@dataclass(frozen=True)
class Place:
    """One place a group may run."""

    index: int  # 0: as declared; k: capacity[k-1]
    cloud: str
    region: str
    zone: str | None
    types: tuple[str, ...]  # empty: the group's GPU requirement picks them
    market: Market
    network: Network | None  # the stack's network there; None when the stack has none

    @property
    def label(self) -> str:
        where = f"{self.cloud} {self.zone or self.region}"
        return f"{where} {'/'.join(self.types) or 'by gpu requirement'} {self.market.type}"


def network_at(spec: StackSpec, cloud: str, region: str, zone: str | None) -> Network | None:
    """The stack's first network on `cloud` in `region` (with a subnet in `zone` when one is given)."""
    for net in spec.networks:
        if net.cloud == cloud and spec.region_of(net) == region and (
                zone is None or any(s.zone == zone for s in net.subnets)):
            return net
    return None


def one_zone(group: NodeGroup, fabric: object | None) -> bool:
    """Whether the group's fleet keeps to its network's first subnet (the fleets take subnets[:1]):
    a group with a fabric (`fabric`: infra/resolve/groups.py pick; EFA, eRDMA and an HCC are one zone
    each), and on AWS a multi-node training group (its cluster placement group, which AWS confines to one zone)."""
    return fabric is not None or (group.kind == "vm" and clouds.profile(group.cloud).multi_node_one_zone
                                  and fab.multi_node(group))


def declared_zone(spec: StackSpec, group: NodeGroup, own: Network | None) -> str | None:
    """The one zone the group's fleet is in as declared (place 0), or None when it spreads over
    several: a zone candidate naming it is then the same place, one naming a zone of a spread group
    narrows it."""
    if own is None or not own.subnets:
        return None
    picked = pick(spec, group, spec.catalog()) if group.kind == "vm" else None
    confined = picked is not None and bool(picked.types) and one_zone(group, picked.fabric)
    zones = {s.zone for s in (own.subnets[:1] if confined else own.subnets)}
    return zones.pop() if len(zones) == 1 else None


def declared_types(group: NodeGroup) -> tuple[str, ...]:
    return tuple([group.instance_type] + group.fallback_types) if group.instance_type else tuple(group.fallback_types)


def places(spec: StackSpec, group: NodeGroup) -> list[Place]:
    """Where the group may run, in order: as declared, then each candidate with the group's values
    where it leaves them out. A cloud the stack has no account on keeps the group's region (the
    checks name the missing account)."""
    own = next((n for n in spec.networks if n.name == group.network), None)
    own_region = spec.region_of(own) if own is not None else ""
    out = [Place(0, group.cloud, own_region, declared_zone(spec, group, own), declared_types(group), group.market, own)]
    for k, cand in enumerate(group.capacity, start=1):
        cloud = cand.cloud or group.cloud
        account = spec.clouds.get(cloud)
        region = cand.region or (own_region if cloud == group.cloud or account is None else account.region)
        types = tuple(cand.types) or (declared_types(group) if cloud == group.cloud else ())
        if cand.zone is not None and own is not None and (cloud, region) == (group.cloud, own_region):
            # another zone of the group's own region: its own network, when that has a subnet there
            net = own if any(s.zone == cand.zone for s in own.subnets) else None
        else:
            net = network_at(spec, cloud, region, cand.zone)
        out.append(Place(k, cloud, region, cand.zone, types, cand.market or group.market, net))
    return out


def zone_of(declared: StackSpec, group: str) -> str | None:
    """The zone a group's fleet is confined to: its active candidate's zone, or None (every subnet
    of its network, as declared). `declared`: the spec before placement (Stack.declared)."""
    found = next((g for g in declared.node_groups if g.name == group), None)
    if found is None or not 0 < found.active_candidate <= len(found.capacity):
        return None
    return found.capacity[found.active_candidate - 1].zone


def at(spec: StackSpec, group: NodeGroup, index: int) -> NodeGroup:
    """The group as it runs at place `index` (0: unchanged)."""
    if index == 0 or index > len(group.capacity):
        return group
    place = places(spec, group)[index]
    update: dict[str, object] = {"cloud": place.cloud, "market": place.market}
    if place.network is not None:
        update["network"] = place.network.name
    if place.types:
        update |= {"instance_type": place.types[0], "fallback_types": list(place.types[1:]), "gpu": None}
    return group.model_copy(update=update)


def placed(spec: StackSpec) -> StackSpec:
    """The spec with every group at its activeCandidate (the same spec when all are at 0)."""
    if all(g.active_candidate == 0 for g in spec.node_groups):
        return spec
    groups = [at(spec, g, g.active_candidate) for g in spec.node_groups]
    return spec.model_copy(update={"node_groups": groups})
