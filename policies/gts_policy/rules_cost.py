"""The pack's cost, spot and hardware rules: caps on the stack's and each group's GPU capacity
at its maximum, the budget, the prices' age, the spot share, instance families, team quotas and
markets, and the hardware a training or inference group needs. Each registers itself where it is
written (`@stack_rule` / `@resource_rule`, registry.py), in the pack's order."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import catalog as cat
from .registry import resource_rule, stack_rule
from .resources import Capacity, Evaluation, Res, capacity, index_by_id

RAM_PER_VRAM = cat.RAM_PER_VRAM


def _item(itype: str) -> cat.InstanceType | None:
    catalog = cat.pack_catalog()
    return next((catalog.get(c, itype) for c in cat.CLOUDS if catalog.get(c, itype)), None)


SCHEDULES = {  # type -> (the group it targets, the sizes it sets)
    "aws:autoscaling/schedule:Schedule": ("autoscalingGroupName", ("maxSize", "desiredCapacity")),
    "alicloud:ess/scheduledTask:ScheduledTask": ("scalingGroupId", ("maxValue", "desiredCapacity")),
    "tencentcloud:As/schedule:Schedule": ("scalingGroupId", ("maxSize", "desiredCapacity")),
}


def _scheduled_max(r: Res, cap: Capacity, schedules: list[Res]) -> int:
    """The largest size any scheduled action (`schedules`: the stack's resources of a SCHEDULES
    type) can give this capacity: caps hold against what a schedule can do, not only the group's
    own max. Linked by target (name or id) and, where the target is not known before creation, by
    the stack's naming (`<group>-<action>`), erring on the side of counting."""
    ids = {r.name, f"{r.name}-id", str(r.props.get("id", "")), str(r.props.get("name", ""))} - {""}
    best = cap.max_nodes
    for s in schedules:
        target_key, sizes = SCHEDULES[s.type]
        target = str(s.get(target_key) or "")
        linked = (target in ids or any(target.startswith(i + "-") for i in ids if i == r.name)
                  or s.name.startswith(r.name + "-") or s.name.startswith(cap.group + "-"))
        if linked:
            best = max(best, *(int(s.get(k) or 0) for k in sizes))
    return best


def _capacities(resources: list[Res]) -> list[tuple[Res, Capacity]]:
    """Each GPU capacity among the resources, at its largest scheduled size: once per offline
    evaluation (resources.Evaluation), once per rule under the engine."""
    if isinstance(resources, Evaluation):
        if "capacities" not in resources.derived:
            resources.derived["capacities"] = _find_capacities(resources)
        return list(resources.derived["capacities"])
    return _find_capacities(resources)


def _find_capacities(resources: list[Res]) -> list[tuple[Res, Capacity]]:
    by_id = index_by_id(resources)
    # The schedules picked out once: every capacity against every resource made the rules
    # quadratic in the stack's size (issue 44).
    schedules = [s for s in resources if s.type in SCHEDULES]
    out = []
    for r in resources:
        cap = capacity(r, by_id)
        # GPU capacity only: a cluster's system pool (CPU types, not in the catalog) is not a node group.
        if cap is not None and any(_item(t) for t in cap.instance_types):
            scheduled = _scheduled_max(r, cap, schedules)
            if scheduled > cap.max_nodes:
                cap = dataclasses.replace(cap, max_nodes=scheduled)
            out.append((r, cap))
    return out


def _group_prices(cap: Capacity, cfg: Mapping[str, Any]) -> Mapping[str, float] | None:
    """USD per node-hour of each type of the capacity's node group, as the stack prices it in the
    group's region (with its overrides): the stack's policy config carries them (`groupPrices`,
    infra/stack/policy_config.py). A pool of a group (EKS / TKE name an on-demand base <group>-od) is
    its group's; the longest matching group name wins."""
    groups = cfg.get("groupPrices") or {}
    if cap.group in groups:
        return dict(groups[cap.group])
    owners = sorted((g for g in groups if cap.group.startswith(f"{g}-")), key=len, reverse=True)
    return dict(groups[owners[0]]) if owners else None


def _peak_hourly_usd(cap: Capacity, cny_per_usd: float, cfg: Mapping[str, Any]) -> float:
    """All nodes up, at the on-demand price of the dearest listed type (the worst case): the
    group's regional price from the stack, else the catalog's reference price."""
    regional = _group_prices(cap, cfg)
    if regional:
        prices = [float(regional[t]) for t in cap.instance_types if t in regional]
    else:
        prices = [cat.to_usd(i.price_ondemand, i.currency, cny_per_usd)
                  for i in (_item(t) for t in cap.instance_types) if i]
    return cap.max_nodes * max(prices, default=0.0)


# ------------------------------------------------------------------------ cost and spot

@stack_rule("stack-cost-cap", "The stack's GPU capacity at its maximum stays under an hourly and monthly cap.",
            "mandatory", {"maxHourlyUsd": {"type": "number"}, "maxMonthlyUsd": {"type": "number"},
                          "cnyPerUsd": {"type": "number"}, "groupPrices": {"type": "object"}})
def stack_cost_cap(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    rate = float(cfg.get("cnyPerUsd", 7.2))
    total = sum(_peak_hourly_usd(c, rate, cfg) for _, c in _capacities(resources))
    out = []
    if "maxHourlyUsd" in cfg and total > float(cfg["maxHourlyUsd"]):
        out.append(("stack", f"GPU capacity at its maximum costs ${total:,.2f}/h on-demand, over the cap of "
                             f"${float(cfg['maxHourlyUsd']):,.2f}/h; lower node-group max sizes or raise maxHourlyUsd"))
    monthly = total * cat.HOURS_PER_MONTH
    if "maxMonthlyUsd" in cfg and monthly > float(cfg["maxMonthlyUsd"]):
        out.append(("stack", f"GPU capacity at its maximum costs ${monthly:,.0f}/month on-demand, over the cap of "
                             f"${float(cfg['maxMonthlyUsd']):,.0f}; lower max sizes or raise maxMonthlyUsd"))
    return out


@stack_rule("node-group-cost-cap", "Each node group at its maximum stays under an hourly cap.", "mandatory",
            {"maxHourlyUsdPerGroup": {"type": "number"}, "cnyPerUsd": {"type": "number"},
             "groupPrices": {"type": "object"}})
def group_cost_cap(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    rate = float(cfg.get("cnyPerUsd", 7.2))
    cap_usd = float(cfg.get("maxHourlyUsdPerGroup", float("inf")))
    return [(r.name, f"node group {c.group} can reach ${_peak_hourly_usd(c, rate, cfg):,.2f}/h on-demand, over "
                     f"${cap_usd:,.2f}/h; lower its max size or pick cheaper types")
            for r, c in _capacities(resources) if _peak_hourly_usd(c, rate, cfg) > cap_usd]


BUDGET_SCHEMA: dict[str, dict[str, Any]] = {"budgetMonthlyUsd": {"type": "number"}, "plannedMonthlyUsd": {"type": "number"},
                 "thresholdsPercent": {"type": "array", "items": {"type": "number"}}}


@stack_rule("budget-covers-plan", "The planned monthly cost stays within the stack's budget.", "mandatory",
            BUDGET_SCHEMA)
def budget_covers_plan(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The stack's own plan against its own budget (both from the stack: infra/stack/policy_config.py)."""
    if "budgetMonthlyUsd" not in cfg or "plannedMonthlyUsd" not in cfg:
        return []
    budget, planned = float(cfg["budgetMonthlyUsd"]), float(cfg["plannedMonthlyUsd"])
    if planned <= budget:
        return []
    return [("stack", f"the plan costs ${planned:,.0f}/month, over the monthly budget of ${budget:,.0f}: raise "
                      "budget.monthlyLimitUsd or shrink the node groups")]


@stack_rule("budget-headroom", "The planned monthly cost stays under the budget's first alert threshold.",
            "advisory", BUDGET_SCHEMA)
def budget_headroom(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    if "budgetMonthlyUsd" not in cfg or "plannedMonthlyUsd" not in cfg:
        return []
    budget, planned = float(cfg["budgetMonthlyUsd"]), float(cfg["plannedMonthlyUsd"])
    first = min(float(t) for t in (cfg.get("thresholdsPercent") or [100]))
    if planned <= budget and planned > budget * first / 100:
        return [("stack", f"the plan costs ${planned:,.0f}/month, {100 * planned / budget:.0f}% of the budget: the "
                          f"{first:g}% alert will fire every month")]
    return []


PRICES_SCHEMA: dict[str, dict[str, Any]] = {
    "maxAgeDays": {"type": "integer"}, "pricesDated": {"type": "string"}, "pricesOldest": {"type": "string"},
    "pricesJudgedOn": {"type": "string"}}


@stack_rule("prices-fresh", "The prices the stack's costs and caps rest on are younger than maxAgeDays (90).",
            "advisory", PRICES_SCHEMA)
def prices_fresh(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The prices the stack's costs and caps rest on are younger than maxAgeDays (default 90).
    Their date comes from the stack (infra/prices/age.py through the policy config); they are
    judged on pricesJudgedOn, else GTS_TODAY, else today. A verdict whose level the
    organisation sets (advisory by default): the calendar alone never stops a deployment."""
    import datetime
    import os

    dated = cfg.get("pricesDated")
    if not dated:
        return []
    judged = str(cfg.get("pricesJudgedOn") or os.environ.get("GTS_TODAY") or datetime.date.today().isoformat())
    days = (datetime.date.fromisoformat(judged) - datetime.date.fromisoformat(str(dated))).days
    most = int(cfg.get("maxAgeDays", 90))
    if days <= most:
        return []
    return [("stack", f"prices are {days} days old (oldest: {cfg.get('pricesOldest', dated)}), over {most} days: "
                      "refresh them with `make prices` and commit infra/data/prices.csv")]


@stack_rule("gpu-spot-only", "All GPU capacity is spot (dev).", "disabled")
def spot_only(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"node group {c.group} buys capacity that is not spot ({r.type}: on-demand or "
                     "prepaid); in this environment all GPU capacity must be spot — set market.type: spot "
                     "with onDemandBase: 0")
            for r, c in _capacities(resources) if not c.spot]


@resource_rule("gpu-families-allowed", "GPU instance families are on the environment's list.", "mandatory",
               {"families": {"type": "array", "items": {"type": "string"}}})
def allowed_families(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    allowed = set(cfg.get("families") or [])
    cap = capacity(r, {})
    if not allowed or cap is None or not any(_item(t) for t in cap.instance_types):
        return []
    out = []
    for t in cap.instance_types:
        item = _item(t)
        if item is None or item.family not in allowed:
            out.append(f"node group {cap.group} uses {t} (family {item.family if item else 'unknown'}); "
                       f"allowed here: {', '.join(sorted(allowed))}")
    return out


@stack_rule("gpu-max-nodes", "Node groups cannot grow past a cap.", "mandatory",
            {"maxNodesPerGroup": {"type": "integer"}})
def max_nodes(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    limit = int(cfg.get("maxNodesPerGroup", 1 << 30))
    return [(r.name, f"node group {c.group} may grow to {c.max_nodes} nodes, over the cap of {limit}; "
                     "lower scaling.max")
            for r, c in _capacities(resources) if c.max_nodes > limit]


# minimum 1: the engine refuses a share of 0 or less by name (it would otherwise read as one spare per node)
SPARES_SCHEMA: dict[str, dict[str, Any]] = {"nodesPerSpare": {"type": "integer", "minimum": 1},
                                             "groupSpares": {"type": "object"}}


@stack_rule("gpu-spares-share", "Warm spares (scaling.spares) stay within one per nodesPerSpare (8) nodes of the "
            "run; the message weighs their cost against the run's expected member losses.", "mandatory", SPARES_SCHEMA)
def spares_share(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Warm spares (scaling.spares) at most one per `nodesPerSpare` nodes of the run (8 unless
    configured), rounded up; the message weighs what they cost against the member losses they
    cover. The stack's figures come in its policy config (groupSpares, infra/stack/policy_config.py)."""
    per = max(1, int(cfg.get("nodesPerSpare", 8)))
    wanted: Mapping[str, Any] = cfg.get("groupSpares") or {}
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for r, c in _capacities(resources):
        info = wanted.get(c.group)
        if not isinstance(info, Mapping) or c.group in seen:
            continue
        seen.add(c.group)
        k, world = int(info.get("spares", 0)), int(info.get("world", 1))
        allowed = -(-world // per)
        if k <= allowed:
            continue
        monthly, losses = float(info.get("monthlyUsd", 0)), float(info.get("lossesPerMonth", 0))
        cover = f"${monthly / losses:,.0f} per loss" if losses else "no loss expected"
        out.append((r.name, f"node group {c.group} keeps {k} warm spares for a run of {world} nodes, over the cap of "
                            f"{allowed} (one per {per} nodes): they cost ${monthly:,.0f}/month against "
                            f"{losses:.1f} expected member losses a month ({cover}); lower scaling.spares to "
                            f"{allowed}, or raise nodesPerSpare's share in the pack's config"))
    return out



def gpu_usage(resources: list[Res]) -> dict[tuple[str, str], int]:
    """GPUs per (cloud, GPU model) the stack's capacity can reach (schedules included). A node of
    a group with fallback types is counted as its model's largest type: the worst case, per model."""
    used: dict[tuple[str, str], int] = {}
    for _, c in _capacities(resources):
        largest: dict[tuple[str, str], int] = {}
        for item in (_item(t) for t in c.instance_types):
            if item is not None:
                key = (item.cloud, item.gpu_model)
                largest[key] = max(largest.get(key, 0), item.gpu_count)
        for key, per_node in largest.items():
            used[key] = used.get(key, 0) + c.max_nodes * per_node
    return used


@stack_rule("team-gpu-quota", "A team stack's GPUs at their maximum stay within the team's quota per cloud and "
            "model (teams.yaml).", "mandatory", {"team": {"type": "string"}, "gpuQuota": {"type": "object"}})
def team_gpu_quota(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A team stack's GPUs at its maximum within the team's quota (teams.yaml, per cloud and model)."""
    quota = cfg.get("gpuQuota")
    if not isinstance(quota, Mapping):
        return []
    team = str(cfg.get("team", "this team"))
    out = []
    for (cloud, model), gpus in sorted(gpu_usage(resources).items()):
        granted = int((quota.get(cloud) or {}).get(model, 0))
        if gpus > granted:
            out.append(("stack", f"team {team}: {gpus} {model} GPUs on {cloud} at the node groups' maximum, over its "
                                 f"quota of {granted} (teams.yaml gpus.{cloud}.{model}); lower scaling.max or ask "
                                 "for more quota in a pull request to teams.yaml"))
    return out


@stack_rule("team-markets", "A spot-only team keeps no more on-demand nodes than its registry entry allows.",
            "mandatory", {"team": {"type": "string"}, "spotOnly": {"type": "boolean"},
                          "onDemandBaseMax": {"type": "integer"}})
def team_markets(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A spot-only team keeps at most onDemandBaseMax on-demand (or prepaid) nodes, all groups together."""
    if not cfg.get("spotOnly"):
        return []
    team, most = str(cfg.get("team", "this team")), int(cfg.get("onDemandBaseMax", 0))
    fixed: dict[str, int] = {}
    for _, c in _capacities(resources):  # an EKS / TKE group's on-demand base is a pool of its own
        fixed[c.group] = fixed.get(c.group, 0) + (c.on_demand_nodes if c.spot else c.max_nodes)
    total = sum(fixed.values())
    if total <= most:
        return []
    groups = ", ".join(f"{g} {n}" for g, n in sorted(fixed.items()) if n)
    return [("stack", f"team {team} is spot-only with at most {most} on-demand node(s) (teams.yaml markets), but its "
                      f"groups keep {total} ({groups}); use market.type: spot with a smaller onDemandBase")]


@stack_rule("reserve-always-on", "Always-on on-demand capacity should be reserved or under a savings plan.",
            "advisory")
def reserve_always_on(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"node group {c.group} keeps {min(c.on_demand_nodes, c.min_nodes)} on-demand node(s) running "
                     "around the clock; reserved capacity or a savings plan would cost 30-40% less")
            for r, c in _capacities(resources) if min(c.on_demand_nodes, c.min_nodes) >= 1]


# ------------------------------------------------------------------------------ hardware

def _types_of(resources: list[Res], workload: str) -> list[tuple[Res, Capacity, str, cat.InstanceType]]:
    """(resource, capacity, type, catalog row) for each listed type of the given workload
    ("training" also covers capacity whose workload is not tagged)."""
    out = []
    for r, c in _capacities(resources):
        if (c.workload == "inference") != (workload == "inference"):
            continue
        for t in c.instance_types:
            item = _item(t)
            if item is not None:
                out.append((r, c, t, item))
    return out


@stack_rule("host-ram-ratio", "Training hosts have RAM >= 1.5 x total GPU memory.", "mandatory")
def host_ram(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"{t} has {item.ram_gib} GiB RAM for {item.total_vram_gb} GB of GPU memory; "
                     f"training hosts need >= {RAM_PER_VRAM} x GPU memory "
                     f"({item.total_vram_gb * RAM_PER_VRAM:g} GiB): pick a larger type")
            for r, _, t, item in _types_of(resources, "training") if not item.ram_ok]


@stack_rule("training-dataset-disk", "Training nodes have >= 1 TB of NVMe or data disk for datasets.", "mandatory",
            {"minGb": {"type": "integer"}})
def dataset_disk(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    need = int(cfg.get("minGb", 1000))
    out = []
    for r, c in _capacities(resources):
        if c.workload == "inference":
            continue
        nvme = min((i.nvme_gb for i in (_item(t) for t in c.instance_types) if i), default=0)
        if max(nvme, c.disk_gb) < need:
            out.append((r.name, f"node group {c.group} has {max(nvme, c.disk_gb)} GB of NVMe / data disk per node; "
                                f"training nodes need >= {need} GB for datasets — set scratch.sizeGb"))
    return out


@stack_rule("gpu-memory-minimum", "GPUs have at least the workload's minimum memory.", "mandatory",
            {"minGpuMemoryGb": {"type": "integer"}})
def gpu_memory(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    need = int(cfg.get("minGpuMemoryGb", 0))
    return [(r.name, f"{t} has {item.gpu_vram_gb} GB per GPU; the workload needs >= {need} GB")
            for r, _, t, item in _types_of(resources, "training") if item.gpu_vram_gb < need]


INFERENCE_GPUS = ("T4", "A10", "A10G", "L4")


@stack_rule("inference-gpu-class", "Inference runs on inference-class GPUs (T4 / A10 / L4).", "advisory")
def inference_class(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"inference group {c.group} runs on {item.gpu_model} ({t}); "
                     f"{'/'.join(INFERENCE_GPUS)} serve for less")
            for r, c, t, item in _types_of(resources, "inference") if item.gpu_model not in INFERENCE_GPUS]
