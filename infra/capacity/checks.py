"""The rules for `nodeGroups[].capacity` (docs/capacity.md): every candidate names a cloud the
stack has an account on (its bucket comes with it), a known region and zone, a network of the
stack there (for a zone: one with a subnet in it, the group's own in its own region), types of
that cloud's catalog priced in that region, a market its account can buy, an image registry on
that cloud, and, in a team stack, the team's regions and GPU quota. Each
problem is one line naming the key and what to add. Called by infra/checks/validation.py on the spec as
declared (before the groups are placed at their activeCandidate)."""

from __future__ import annotations

from infra.capacity import reservations
from infra.capacity.places import Place, at, declared_zone, places
from infra.core import catalog as cat
from infra.core.errors import Problem, suggest
from infra.model.spec import NodeGroup, StackSpec
from infra.model.spec_problems import check_region


def check(spec: StackSpec) -> list[Problem]:
    out: list[Problem] = reservations.check(spec)
    for i, group in enumerate(spec.node_groups):
        path = f"nodeGroups[{i}]"
        if group.active_candidate > len(group.capacity):
            out.append(Problem(f"{path}.activeCandidate", f"{group.active_candidate} names no place: the group has "
                                                          f"{len(group.capacity)} capacity candidate(s); use 0.."
                                                          f"{len(group.capacity)} (0 = as declared)"))
        if not group.capacity:
            continue
        if group.kind != "vm":
            out.append(Problem(f"{path}.capacity", "candidates move VM fleets only; a kubernetes pool's cluster "
                                                   "stays where it is: remove capacity, or make the group kind: vm"))
            continue
        all_places = places(spec, group)
        for place in all_places[1:]:
            out += _check_place(spec, group, place, f"{path}.capacity[{place.index - 1}]", all_places)
    return out


def _same(a: Place, b: Place) -> bool:
    return (a.cloud, a.region, a.types, a.market.type) == (b.cloud, b.region, b.types, b.market.type)


def _zone(spec: StackSpec, group: NodeGroup, place: Place) -> str | None:
    """The zone the group's fleet is in at the place: its own, else the one zone the fleet keeps to
    there (a one-zone group, or a network in one zone: places.declared_zone), else None."""
    if place.zone is not None or place.index == 0:
        return place.zone
    return declared_zone(spec, at(spec, group, place.index), place.network)


def _check_place(spec: StackSpec, group: NodeGroup, place: Place, path: str, every: list[Place]) -> list[Problem]:
    if place.cloud not in spec.clouds:
        return [Problem(f"{path}.cloud", f"{place.cloud!r} has no account in this stack: add clouds.{place.cloud} "
                                         "(its region; the stack's bucket there comes with it) or remove the candidate")]
    found = check_region(place.cloud, place.region, f"{path}.region")
    if found:
        return found
    zones = cat.load_regions()[place.cloud].get(place.region, [])
    if place.zone is not None and zones and place.zone not in zones:
        return [Problem(f"{path}.zone", f"{place.zone!r} is not a zone of {place.region}{suggest(place.zone, zones)} "
                                        f"Zones: {', '.join(zones)}.")]
    zone = _zone(spec, group, place)
    twin = next((p for p in every if p.index < place.index and _same(p, place) and _zone(spec, group, p) == zone), None)
    if twin is not None:
        where = "the group as declared" if twin.index == 0 else f"capacity[{twin.index - 1}]"
        return [Problem(path, f"is the same place as {where} ({place.label}): change its cloud, region, zone, "
                              "types or market, or remove it")]
    out = _check_types(spec, group, place, path) + _check_market(spec, place, path) + _zone_market(group, place, path)
    if place.network is None and place.zone is not None:
        out.append(_no_subnet(spec, group, place, f"{path}.zone"))
    elif place.network is None:
        out.append(Problem(path, f"the stack has no network on {place.cloud} in {place.region}: add networks[] "
                                 f"{{name: ..., cloud: {place.cloud}, region: {place.region}, cidr: ..., subnets: "
                                 "[{zone: ..., cidr: ...}]}"))
    has_group = any(g.cloud == place.cloud for g in spec.node_groups)
    if not has_group and place.cloud not in spec.training.prebuilt_images:
        out.append(Problem(path, f"no image registry on {place.cloud}: the stack builds one only on a cloud with a "
                                 f"node group; add training.prebuiltImages.{place.cloud} (a trainer image pinned by "
                                 f"digest) or a node group on {place.cloud}"))
    return out + _check_team(spec, group, place, path)


# Markets bought for one zone: a zone candidate on one would buy it again there (Tencent PREPAID
# instances recreated, as PREPAID cannot be deleted directly; a second Alibaba elasticity assurance,
# `zone_ids` being ForceNew and its delete a no-op; a new AWS capacity reservation in that zone).


def _zone_market(group: NodeGroup, place: Place, path: str) -> list[Problem]:
    """A zone candidate whose market (its own, or the group's it inherits) is bought for one zone."""
    if place.zone is None or not (place.market.prepaid or place.market.reservation):
        return []
    own = group.capacity[place.index - 1].market is not None
    what = f"market {place.market.type!r} is" if own else f"inherits the group's market {place.market.type!r},"
    return [Problem(f"{path}.market" if own else f"{path}.zone",
                    f"{what} bought for one zone: at {place.zone} it would be bought again while the first is "
                    "still billed; give the candidate market: {type: spot} or {type: on-demand}")]


def _no_subnet(spec: StackSpec, group: NodeGroup, place: Place, path: str) -> Problem:
    """A zone candidate whose network has no subnet in that zone: the group's fleet would have
    nowhere to launch there (its fleet is declared with that zone's subnets only)."""
    own = next((k for k, n in enumerate(spec.networks) if n.name == group.network), None)
    if own is not None and (place.cloud, place.region) == (group.cloud, spec.region_of(spec.networks[own])):
        return Problem(path, f"{place.zone!r}: the group's network {group.network!r} has no subnet in {place.zone}: "
                             f"add {{zone: {place.zone}, cidr: ...}} to networks[{own}].subnets, or remove the candidate")
    return Problem(path, f"{place.zone!r}: the stack has no network on {place.cloud} in {place.region} with a subnet "
                         f"in {place.zone}: add networks[] {{name: ..., cloud: {place.cloud}, region: {place.region}, "
                         f"cidr: ..., subnets: [{{zone: {place.zone}, cidr: ...}}]}}")


def _check_types(spec: StackSpec, group: NodeGroup, place: Place, path: str) -> list[Problem]:
    if not place.types:
        if place.cloud != group.cloud or group.gpu is None:
            return [Problem(f"{path}.types", f"give the {place.cloud} instance types to run on there (the group's "
                                             "own types are another cloud's)")]
        return []
    catalog = spec.catalog()
    out = []
    for k, name in enumerate(place.types):
        item = catalog.get(place.cloud, name)
        if item is None:
            known = [t.instance_type for t in catalog.of_cloud(place.cloud)]
            out.append(Problem(f"{path}.types[{k}]", f"{name!r} is not a GPU type of {cat.CLOUD_NAMES[place.cloud]} in "
                                                     f"the catalog{suggest(name, known)} (infra/data/gpu_catalog.csv)"))
        elif catalog.priced(place.cloud, name, place.region) is None:
            out.append(Problem(f"{path}.types[{k}]", f"{name} has no price in {place.region}: run `make prices "
                                                     f"CLOUD={place.cloud} REGION={place.region}` or give "
                                                     "pricing.overrides with that region"))
    return out


def _check_market(spec: StackSpec, place: Place, path: str) -> list[Problem]:
    site = spec.clouds[place.cloud].site  # type: ignore[index]  # checked above: an account of the stack
    reason = cat.market_unavailable(place.cloud, site, place.market.type)
    if reason is None:
        return []
    return [Problem(f"{path}.market.type", f"{place.market.type!r} cannot be bought on the {site}-site "
                                           f"{cat.CLOUD_NAMES[place.cloud]} account: {reason}")]


def _check_team(spec: StackSpec, group: NodeGroup, place: Place, path: str) -> list[Problem]:
    """A team stack's candidates stay in the team's regions and GPU quota (teams.yaml)."""
    team = spec.team
    if team is None:
        return []
    allowed = team.regions.get(place.cloud, [])  # type: ignore[call-overload]  # a Cloud literal
    if place.region not in allowed:
        return [Problem(f"{path}.region", f"{place.region} is not one of team {team.name}'s {place.cloud} regions "
                                          f"({', '.join(allowed) or 'none'}; teams.yaml)")]
    catalog = spec.catalog()
    quota = {m.lower(): n for m, n in team.gpus.get(place.cloud, {}).items()}  # type: ignore[call-overload]
    for name in place.types:
        item = catalog.get(place.cloud, name)
        need = group.scaling.max * item.gpu_count if item else 0
        if item is not None and quota.get(item.gpu_model.lower(), 0) < need:
            return [Problem(path, f"{group.scaling.max} x {name} needs {need} {item.gpu_model} GPU(s) on "
                                  f"{place.cloud}; team {team.name}'s quota there is "
                                  f"{quota.get(item.gpu_model.lower(), 0)} (teams.yaml gpus)")]
    return []
