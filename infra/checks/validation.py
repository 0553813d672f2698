"""Reading a stack spec from config values: pydantic's shape and range errors and the
cross-field rules (catalog, regions, CIDRs, account-site markets, schedules), all reported at
once as key paths in the stack file's own spelling with the bad value, what is allowed and a
close match. Nothing is registered until `parse()` returns."""

from __future__ import annotations

import re
from collections.abc import Mapping
from ipaddress import IPv4Network
from typing import Any

from croniter import croniter
from pydantic import ValidationError

from infra.capacity import checks as capacity_checks, places
from infra.checks import cloud_rules, resolved_checks, value_checks
from infra.checks.resolved_checks import SPOT_CAP_FLOOR, TeamsReader
from infra.clouds import profile
from infra.core import catalog as cat
from infra.core.errors import Problem, SpecError, suggest
from infra.core.schedule import cron_in_beijing
from infra.model.spec import CONFIG_KEYS, REQUIRED_TAGS, Network, NodeGroup, StackSpec
from infra.model.spec_patterns import ENV_SAFE
from infra.model.spec_problems import _problem, check_region, problems_of
from infra.model.stacktext import decode, stray_keys
from infra.resolve import sharedfs
from infra.resolve.groups import Stack, requirement, schedule_bounds
from policies.gts_policy.addresses import opens_internet


# --------------------------------------------------------------------------------------
# Loading and error reporting
# --------------------------------------------------------------------------------------

def parse_values(values: Mapping[str, str], project: str, source: str, teams: TeamsReader | None = None) -> Stack:
    """The stack from a full config map (`<project>:<key>` -> string) as the Pulumi CLI hands it:
    keys under another namespace are refused first (a misspelled project hides them)."""
    stray = stray_keys(values, project)
    if stray:
        raise SpecError(stray, source)
    prefix = f"{project}:"
    return parse_stack(decode({k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}), source, teams)


def parse(raw: Mapping[str, Any], source: str = "stack config", teams: TeamsReader | None = None) -> StackSpec:
    """Build and fully check a StackSpec from config values; raise SpecError listing every problem."""
    return parse_stack(raw, source, teams).spec


def parse_stack(raw: Mapping[str, Any], source: str = "stack config", teams: TeamsReader | None = None) -> Stack:
    """The same, returning the stack with its groups resolved: resolved once, for the checks that
    need them, and handed on (the program, the plan and the commands take it from here). `teams`
    reads the team registry a stack with kubernetes.queues names; the caller, at the edge, owns
    that read (infra/stack/stackfile.py teams_reader)."""
    unknown = [k for k in raw if k not in CONFIG_KEYS]
    problems = [Problem(k, f"unknown config key{suggest(k, CONFIG_KEYS)} Known keys: {', '.join(CONFIG_KEYS)}.")
                for k in unknown]
    try:
        spec = StackSpec.model_validate({k: v for k, v in raw.items() if k in CONFIG_KEYS})
    except ValidationError as exc:
        problems += [_problem(e) for e in exc.errors()]
        raise SpecError(problems, source) from None
    stack, found = checked(spec, teams)
    problems += found
    if problems or stack is None:
        raise SpecError(problems, source)
    return stack


# --------------------------------------------------------------------------------------
# Cross-field checks
# --------------------------------------------------------------------------------------

def check(spec: StackSpec, teams: TeamsReader | None = None) -> list[Problem]:
    """Rules that span fields or need the catalog and region data."""
    return checked(spec, teams)[1]


def checked(spec: StackSpec, teams: TeamsReader | None = None) -> tuple[Stack | None, list[Problem]]:
    """The problems, and the stack resolved once the spec is whole enough to resolve (else None)."""
    problems: list[Problem] = []
    problems += _check_pricing(spec)
    if problems:  # the catalog with the overrides applied is what the other checks read
        return None, problems
    problems += capacity_checks.check(spec)  # the candidates as declared; the rest at the active place
    declared, spec = spec, places.placed(spec)
    problems += _check_tags(spec)
    problems += _check_clouds(spec)
    problems += _check_team(spec)
    nets = _check_networks(spec, problems)
    problems += _check_peerings(spec, nets)
    problems += _check_node_groups(spec, nets) + value_checks.check(spec)
    if not problems:  # the provider limits assume a spec that is whole
        problems += cloud_rules.check(spec)
        problems += sharedfs.check(spec)
    if problems:
        return None, problems
    return resolved_checks.check(spec, teams, declared)  # resolving the groups needs every provider limit met


def _check_tags(spec: StackSpec) -> list[Problem]:
    out = [Problem(f"tags.{t}", f"required tag is missing; add tags: {{{t}: ...}}")
           for t in REQUIRED_TAGS if not spec.tags.get(t)]
    if spec.tags.get("env") and spec.tags["env"] != spec.env:
        out.append(Problem("tags.env", f"{spec.tags['env']!r} differs from env {spec.env!r}; make them equal"))
    # The team the nodes' cost is shown back to reaches their env file (GTS_TEAM).
    if spec.team is None and not re.fullmatch(f"[{ENV_SAFE}]+", spec.team_name):
        key = "tags.team" if "team" in spec.tags else "tags.owner"
        out.append(Problem(key, f"{spec.team_name!r} names the team in the nodes' env file (GTS_TEAM): use letters, "
                                "digits and . _ / : @ % + , = - only (no spaces, quotes or shell characters)"))
    return out


def _check_team(spec: StackSpec) -> list[Problem]:
    """A team stack stays on its team's clouds and regions (teams.yaml)."""
    out: list[Problem] = []
    if (team := spec.team) is not None:
        for i, net in enumerate(spec.networks):
            if net.cloud not in spec.clouds:  # reported with the networks
                continue
            allowed = team.regions.get(net.cloud, [])
            if spec.region_of(net) not in allowed:
                where = f"{net.cloud} regions {', '.join(allowed)}" if allowed else f"no {net.cloud} region"
                out.append(Problem(f"networks[{i}]", f"{net.name} is in {net.cloud} {spec.region_of(net)}, but team "
                                                     f"{team.name} may use {where} (teams.yaml regions)"))
    return out


def _check_clouds(spec: StackSpec) -> list[Problem]:
    out: list[Problem] = []
    for cloud, acct in spec.clouds.items():
        out += check_region(cloud, acct.region, f"clouds.{cloud}.region")
        missing = profile(cloud).app_id_missing
        if missing is not None and acct.app_id is None:
            out.append(Problem(f"clouds.{cloud}.appId", missing))
    return out


def _check_networks(spec: StackSpec, problems: list[Problem]) -> dict[str, Network]:
    nets: dict[str, Network] = {}
    for i, net in enumerate(spec.networks):
        path = f"networks[{i}]"
        if net.name in nets:
            problems.append(Problem(f"{path}.name", f"{net.name!r} is used by another network; names must be unique"))
        nets[net.name] = net
        if net.cloud not in spec.clouds:
            problems.append(Problem(f"{path}.cloud", f"{net.cloud!r} is not configured under clouds; "
                                                     f"add clouds.{net.cloud} or change the network's cloud"))
            continue
        region = spec.region_of(net)
        known = cat.load_regions()[net.cloud]
        if net.region is not None:  # an inherited region is reported at clouds.<cloud>.region
            problems += check_region(net.cloud, region, f"{path}.region")
        zones = known.get(region, [])
        seen: list[IPv4Network] = []
        for j, sub in enumerate(net.subnets):
            spath = f"{path}.subnets[{j}]"
            if zones and sub.zone not in zones:
                problems.append(Problem(f"{spath}.zone", f"{sub.zone!r} is not a zone of {region}"
                                                         f"{suggest(sub.zone, zones)} Zones: {', '.join(zones)}."))
            if not sub.cidr.subnet_of(net.cidr):
                problems.append(Problem(f"{spath}.cidr", f"{sub.cidr} is outside the network's CIDR {net.cidr}; "
                                                         f"pick a subnet of {net.cidr}"))
            clash = next((s for s in seen if s.overlaps(sub.cidr)), None)
            if clash:
                problems.append(Problem(f"{spath}.cidr", f"{sub.cidr} overlaps {clash} in the same network"))
            seen.append(sub.cidr)
        # Judged by the address space the list opens, not by its spelling (0.0.0.0/1 + 128.0.0.0/1).
        alone = [k for k, cidr in enumerate(net.ssh_cidrs) if opens_internet([cidr])]
        for k in alone:
            problems.append(Problem(f"{path}.sshCidrs[{k}]", f"{net.ssh_cidrs[k]} opens SSH to the internet; list "
                                                             "your office or VPN CIDRs, or leave it empty"))
        if not alone and net.ssh_cidrs and opens_internet(net.ssh_cidrs):
            problems.append(Problem(f"{path}.sshCidrs", f"{', '.join(map(str, net.ssh_cidrs))} together open SSH to "
                                                        "the internet; list your office or VPN CIDRs, or leave it empty"))
        # The exporters (node, DCGM, the trainer's metrics) answer whoever reaches them: only a private
        # monitoring source may (infra/model/scrape.py), never a public range, whatever its size.
        for k, cidr in enumerate(net.scrape_cidrs):
            if not cidr.is_private:
                problems.append(Problem(f"{path}.scrapeCidrs[{k}]", f"{cidr} is not a private range: the nodes' "
                                                                    "metrics would be open to it; list your "
                                                                    "Prometheus' private addresses, or leave it empty "
                                                                    "(the network's own CIDR)"))
    return nets


def _check_peerings(spec: StackSpec, nets: Mapping[str, Network]) -> list[Problem]:
    out: list[Problem] = []
    seen: set[str] = set()
    pairs: dict[frozenset[str], int] = {}
    for i, peer in enumerate(spec.peerings):
        path = f"peerings[{i}]"
        if peer.name in seen:
            out.append(Problem(f"{path}.name", f"{peer.name!r} is used by another peering"))
        seen.add(peer.name)
        pair = frozenset((peer.requester, peer.accepter))
        if pair in pairs and len(pair) == 2:
            out.append(Problem(path, f"{peer.requester} and {peer.accepter} are already linked by "
                                     f"peerings[{pairs[pair]}]; the clouds allow one peering per pair of VPCs"))
        pairs.setdefault(pair, i)
        ends = []
        for side in ("requester", "accepter"):
            ref = getattr(peer, side)
            if ref not in nets:
                out.append(Problem(f"{path}.{side}", f"no network named {ref!r}{suggest(ref, nets)}"))
            else:
                ends.append(nets[ref])
        if len(ends) != 2:
            continue
        a, b = ends
        if a.name == b.name:
            out.append(Problem(path, "requester and accepter are the same network"))
        elif a.cloud != b.cloud:
            out.append(Problem(path, f"links {a.cloud} and {b.cloud} networks; peering works within one cloud "
                                     "(use a VPN between clouds)"))
        elif a.cidr.overlaps(b.cidr):
            out.append(Problem(path, f"peered networks {a.name} ({a.cidr}) and {b.name} ({b.cidr}) have "
                                     "overlapping CIDRs; routes between them would be ambiguous — renumber one"))
    return out


def _check_node_groups(spec: StackSpec, nets: Mapping[str, Network]) -> list[Problem]:
    out: list[Problem] = []
    catalog = spec.catalog()
    seen: set[str] = set()
    for i, group in enumerate(spec.node_groups):
        path = f"nodeGroups[{i}]"
        if group.name in seen:
            out.append(Problem(f"{path}.name", f"{group.name!r} is used by another node group"))
        seen.add(group.name)
        if group.cloud not in spec.clouds:
            out.append(Problem(f"{path}.cloud", f"{group.cloud!r} is not configured under clouds"))
            continue
        net = nets.get(group.network)
        if net is None:
            out.append(Problem(f"{path}.network", f"no network named {group.network!r}{suggest(group.network, nets)}"))
        elif net.cloud != group.cloud:
            out.append(Problem(f"{path}.network", f"{group.network!r} is a {net.cloud} network; the group is on {group.cloud}"))
        out += _check_scaling(group, path)
        out += _check_market(spec, group, path)
        region = spec.region_of(net) if net is not None and net.cloud == group.cloud else None
        region = region if region in cat.load_regions()[group.cloud] else None  # a typo is named at its key
        hardware = _check_hardware(spec, catalog, group, path, region)
        out += hardware
        if not hardware and region is not None:
            out += _check_prices(catalog, group, path, region)
    return out


def _check_prices(catalog: cat.Catalog, group: NodeGroup, path: str, region: str) -> list[Problem]:
    """Every named type has a price in the group's region: a figure from another region would
    be wrong by up to 70 % (infra/data/prices.csv)."""
    out = []
    named = [(f"{path}.instanceType", group.instance_type)] if group.instance_type else []
    named += [(f"{path}.fallbackTypes[{k}]", t) for k, t in enumerate(group.fallback_types)]
    for where, name in named:
        if name and catalog.priced(group.cloud, name, region) is None:
            priced = ", ".join(catalog.regions_of(group.cloud, name)) or "nowhere"
            out.append(Problem(where, f"node group {group.name}: {name} has no price in {region} (infra/data/"
                                      f"prices.csv prices it in {priced}); run `make prices CLOUD={group.cloud} "
                                      f"REGION={region}`, or give pricing.overrides [{{cloud: {group.cloud}, "
                                      f"instanceType: {name}, region: {region}, onDemandHourly: ...}}]"))
    return out


def _check_pricing(spec: StackSpec) -> list[Problem]:
    catalog = cat.load_catalog()
    out = []
    for i, o in enumerate(spec.pricing.overrides):
        if o.region is not None:
            out += check_region(o.cloud, o.region, f"pricing.overrides[{i}].region")
        if catalog.get(o.cloud, o.instance_type) is None:
            known = [t.instance_type for t in catalog.of_cloud(o.cloud)]
            name = cat.CLOUD_NAMES[o.cloud]
            out.append(Problem(f"pricing.overrides[{i}].instanceType",
                               f"{o.instance_type!r} is not {_article(name)} {name} type in the catalog"
                               f"{suggest(o.instance_type, known)} (catalog: infra/data/gpu_catalog.csv)"))
    return out


def _never_fires(cron: str) -> bool:
    from datetime import datetime, timezone
    from croniter import CroniterBadDateError

    try:
        croniter(cron, datetime(2026, 1, 1, tzinfo=timezone.utc)).get_next(datetime)
    except CroniterBadDateError:
        return True
    return False


def _check_scaling(group: NodeGroup, path: str) -> list[Problem]:
    out: list[Problem] = []
    s = group.scaling
    if s.min > s.max:
        out.append(Problem(f"{path}.scaling", f"min ({s.min}) is greater than max ({s.max}); make min <= max"))
    elif s.desired is not None and not s.min <= s.desired <= s.max:
        out.append(Problem(f"{path}.scaling.desired", f"{s.desired} is outside min..max ({s.min}..{s.max})"))
    for j, act in enumerate(group.schedule):
        apath = f"{path}.schedule[{j}]"
        if not croniter.is_valid(act.cron) or len(act.cron.split()) != 5:
            out.append(Problem(f"{apath}.cron", f"{act.cron!r} is not a five-field cron expression "
                                                "(minute hour day-of-month month day-of-week, UTC)"))
        elif _never_fires(act.cron):
            out.append(Problem(f"{apath}.cron", f"{act.cron!r} never fires (no such date in any year); check the "
                                                "day of month against the month"))
        if profile(group.cloud).schedules_in_beijing_time and croniter.is_valid(act.cron):
            try:
                cron_in_beijing(act.cron)
            except ValueError as exc:
                out.append(Problem(f"{apath}.cron", f"{exc}; Tencent AS runs schedules in Beijing time"))
        lo, hi = schedule_bounds(group, act)
        if not lo <= act.desired <= hi:
            out.append(Problem(f"{apath}.desired", f"{act.desired} is outside min..max ({lo}..{hi}); "
                                                   "set min/max on the action too"))
    return out


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _check_market(spec: StackSpec, group: NodeGroup, path: str) -> list[Problem]:
    out: list[Problem] = []
    m = group.market
    site = spec.clouds[group.cloud].site
    reason = cat.market_unavailable(group.cloud, site, m.type)
    if reason:
        out.append(Problem(f"{path}.market.type", f"{m.type!r} cannot be bought on {_article(site)} {site}-site "
                                                  f"{cat.CLOUD_NAMES[group.cloud]} account: {reason}"))
    if not m.spot and (m.on_demand_base or m.spot_max_price_usd is not None):
        out.append(Problem(f"{path}.market", "onDemandBase and spotMaxPriceUsd apply only to type: spot"))
    if m.on_demand_base > group.scaling.max:
        out.append(Problem(f"{path}.market.onDemandBase",
                           f"{m.on_demand_base} exceeds scaling.max ({group.scaling.max})"))
    return out


def _check_type(catalog: cat.Catalog, cloud: str, name: str, path: str) -> list[Problem]:
    if catalog.get(cloud, name) is not None:
        return []
    other = next((c for c in cat.CLOUDS if catalog.get(c, name) is not None), None)
    if other is not None:
        return [Problem(path, f"{name!r} is a GPU type of {cat.CLOUD_NAMES[other]}, but the group is on "
                              f"{cat.CLOUD_NAMES[cloud]}; pick a {cloud} type from infra/data/gpu_catalog.csv")]
    known = [t.instance_type for t in catalog.of_cloud(cloud)]
    return [Problem(path, f"{name!r} is not a GPU type of {cat.CLOUD_NAMES[cloud]} in the catalog"
                          f"{suggest(name, known)} (catalog: infra/data/gpu_catalog.csv)")]


def _check_hardware(spec: StackSpec, catalog: cat.Catalog, group: NodeGroup, path: str,
                    region: str | None = None) -> list[Problem]:
    out: list[Problem] = []
    if group.instance_type is not None:
        out += _check_type(catalog, group.cloud, group.instance_type, f"{path}.instanceType")
    for k, name in enumerate(group.fallback_types):
        out += _check_type(catalog, group.cloud, name, f"{path}.fallbackTypes[{k}]")
    if out:
        return out
    req = requirement(spec, group)
    if group.gpu is not None:
        models = catalog.gpu_models(group.cloud)
        if group.gpu.model is not None and group.gpu.model.lower() not in [m.lower() for m in models]:
            return [Problem(f"{path}.gpu.model", f"{group.gpu.model!r} is not offered on "
                                                 f"{cat.CLOUD_NAMES[group.cloud]}{suggest(group.gpu.model, models)} "
                                                 f"Offered: {', '.join(models)}.")]
        if not cat.select(catalog, [group.cloud], req, spec.pricing.cny_per_usd):
            return [Problem(f"{path}.gpu", f"no {cat.CLOUD_NAMES[group.cloud]} type in the catalog has "
                                           f"{req.gpu_count} x {req.gpu_model or 'any'} GPU(s) with >= {req.min_vram_gb} GB each, "
                                           f"RAM >= {cat.RAM_PER_VRAM} x GPU memory and {req.scratch_gb} GB scratch "
                                           f"({req.scratch_source}); relax the requirement"
                                           f"{cat.near_misses(catalog, group.cloud, req)}")]
        if region is not None and not cat.select(catalog, [group.cloud], req, spec.pricing.cny_per_usd, region):
            fits = [c.type.instance_type for c in cat.select(catalog, [group.cloud], req, spec.pricing.cny_per_usd)]
            return [Problem(f"{path}.gpu", f"node group {group.name}: none of the types that meet it ({', '.join(fits)}) "
                                           f"has a price in {region} (infra/data/prices.csv); run `make prices "
                                           f"CLOUD={group.cloud} REGION={region}` or give pricing.overrides with "
                                           "that region")]
        return []
    for k, name in enumerate([group.instance_type or ""] + group.fallback_types):
        item = catalog.get(group.cloud, name)
        assert item is not None
        where = f"{path}.instanceType" if k == 0 else f"{path}.fallbackTypes[{k - 1}]"
        if group.workload == "training" and not item.ram_ok:
            out.append(Problem(where, f"{name} has {item.ram_gib} GiB RAM for {item.total_vram_gb} GB of GPU memory; "
                                      f"training nodes need >= {cat.RAM_PER_VRAM} x ({item.total_vram_gb * cat.RAM_PER_VRAM:g} GiB); "
                                      f"pick a larger type{cat.roomier(catalog, item)} or give a gpu requirement"))
        if item.gpu_vram_gb < req.min_vram_gb:
            out.append(Problem(where, f"{name} has {item.gpu_vram_gb} GB per GPU; the workload needs "
                                      f">= {req.min_vram_gb} GB (minGpuMemoryGb)"))
        if req.scratch_source == "instance-store" and item.nvme_gb < req.scratch_gb:
            out.append(Problem(where, f"{name} has {item.nvme_gb} GB of local NVMe; scratch asks for "
                                      f"{req.scratch_gb} GB from instance-store — use source: auto or data-disk"))
    return out


# Importable here as before: the team registry and tests read pydantic errors and regions the same way.
__all__ = ["SPOT_CAP_FLOOR", "TeamsReader", "check", "check_region", "checked", "parse", "parse_stack", "parse_values",
           "problems_of"]
