"""The rules: cost, spot, hardware, security and tagging. Each is a function over all of the
stack's resources (a cloud-neutral `Res` view) and its config, returning violations that name
the resource, the rule and the fix. Specs and prices come from the stack's own GPU catalog."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import catalog as cat
from . import clouds
from .addresses import opens_internet
from .resources import Capacity, Res, capacity, index_by_id, tags_of, taggable

RAM_PER_VRAM = cat.RAM_PER_VRAM


@dataclass(frozen=True)
class Violation:
    policy: str
    resource: str
    message: str


ResourceCheck = Callable[[Res, Mapping[str, Any]], list[str]]
Remediation = Callable[[Res], dict[str, Any] | None]


@dataclass(frozen=True)
class Rule:
    """A stack rule (`check` over every resource: cost, spot share, cross-resource settings) or a
    resource rule (`per_resource` over one resource, served to the engine as a resource
    validation policy that runs before that resource is created, with `remediate` where the fix
    is safe and unambiguous)."""

    name: str
    description: str
    enforcement: str  # mandatory | advisory | remediate | disabled (default; per-env files override)
    check: Callable[[list[Res], Mapping[str, Any]], list[tuple[str, str]]] | None = None
    schema: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_resource: ResourceCheck | None = None
    remediate: Remediation | None = None

    def run(self, resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
        if self.per_resource is not None:
            return [(r.name, m) for r in resources for m in self.per_resource(r, cfg)]
        assert self.check is not None
        return self.check(resources, cfg)


def sdk_gap(type_token: str, feature: str) -> str | None:
    """Why an SDK cannot set `feature` on `type_token` (infra/data/capabilities.yaml), or None."""
    gaps = cat.pack_capabilities().get("sdkGaps", {}).get(type_token, {})
    return str(gaps[feature]) if feature in gaps else None


def _item(itype: str) -> cat.InstanceType | None:
    catalog = cat.pack_catalog()
    return next((catalog.get(c, itype) for c in cat.CLOUDS if catalog.get(c, itype)), None)


SCHEDULES = {  # type -> (the group it targets, the sizes it sets)
    "aws:autoscaling/schedule:Schedule": ("autoscalingGroupName", ("maxSize", "desiredCapacity")),
    "alicloud:ess/scheduledTask:ScheduledTask": ("scalingGroupId", ("maxValue", "desiredCapacity")),
    "tencentcloud:As/schedule:Schedule": ("scalingGroupId", ("maxSize", "desiredCapacity")),
}


def _scheduled_max(r: Res, cap: Capacity, resources: list[Res]) -> int:
    """The largest size any scheduled action can give this capacity: caps hold against what a
    schedule can do, not only the group's own max. Linked by target (name or id) and, where the
    target is not known before creation, by the stack's naming (`<group>-<action>`), erring on
    the side of counting."""
    ids = {r.name, f"{r.name}-id", str(r.props.get("id", "")), str(r.props.get("name", ""))} - {""}
    best = cap.max_nodes
    for s in resources:
        if s.type not in SCHEDULES:
            continue
        target_key, sizes = SCHEDULES[s.type]
        target = str(s.get(target_key) or "")
        linked = (target in ids or any(target.startswith(i + "-") for i in ids if i == r.name)
                  or s.name.startswith(r.name + "-") or s.name.startswith(cap.group + "-"))
        if linked:
            best = max(best, *(int(s.get(k) or 0) for k in sizes))
    return best


def _capacities(resources: list[Res]) -> list[tuple[Res, Capacity]]:
    by_id = index_by_id(resources)
    out = []
    for r in resources:
        cap = capacity(r, by_id)
        # GPU capacity only: a cluster's system pool (CPU types, not in the catalog) is not a node group.
        if cap is not None and any(_item(t) for t in cap.instance_types):
            scheduled = _scheduled_max(r, cap, resources)
            if scheduled > cap.max_nodes:
                cap = dataclasses.replace(cap, max_nodes=scheduled)
            out.append((r, cap))
    return out


def _group_prices(cap: Capacity, cfg: Mapping[str, Any]) -> Mapping[str, float] | None:
    """USD per node-hour of each type of the capacity's node group, as the stack prices it in the
    group's region (with its overrides): the stack's policy config carries them (`groupPrices`,
    infra/policy_config.py). A pool of a group (EKS / TKE name an on-demand base <group>-od) is
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


def group_cost_cap(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    rate = float(cfg.get("cnyPerUsd", 7.2))
    cap_usd = float(cfg.get("maxHourlyUsdPerGroup", float("inf")))
    return [(r.name, f"node group {c.group} can reach ${_peak_hourly_usd(c, rate, cfg):,.2f}/h on-demand, over "
                     f"${cap_usd:,.2f}/h; lower its max size or pick cheaper types")
            for r, c in _capacities(resources) if _peak_hourly_usd(c, rate, cfg) > cap_usd]


BUDGET_SCHEMA: dict[str, dict[str, Any]] = {"budgetMonthlyUsd": {"type": "number"}, "plannedMonthlyUsd": {"type": "number"},
                 "thresholdsPercent": {"type": "array", "items": {"type": "number"}}}


def budget_covers_plan(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The stack's own plan against its own budget (both from the stack: infra/policy_config.py)."""
    if "budgetMonthlyUsd" not in cfg or "plannedMonthlyUsd" not in cfg:
        return []
    budget, planned = float(cfg["budgetMonthlyUsd"]), float(cfg["plannedMonthlyUsd"])
    if planned <= budget:
        return []
    return [("stack", f"the plan costs ${planned:,.0f}/month, over the monthly budget of ${budget:,.0f}: raise "
                      "budget.monthlyLimitUsd or shrink the node groups")]


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


def spot_only(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"node group {c.group} buys capacity that is not spot ({r.type}: on-demand or "
                     "prepaid); in this environment all GPU capacity must be spot — set market.type: spot "
                     "with onDemandBase: 0")
            for r, c in _capacities(resources) if not c.spot]


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


def max_nodes(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    limit = int(cfg.get("maxNodesPerGroup", 1 << 30))
    return [(r.name, f"node group {c.group} may grow to {c.max_nodes} nodes, over the cap of {limit}; "
                     "lower scaling.max")
            for r, c in _capacities(resources) if c.max_nodes > limit]


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


def host_ram(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"{t} has {item.ram_gib} GiB RAM for {item.total_vram_gb} GB of GPU memory; "
                     f"training hosts need >= {RAM_PER_VRAM} x GPU memory "
                     f"({item.total_vram_gb * RAM_PER_VRAM:g} GiB): pick a larger type")
            for r, _, t, item in _types_of(resources, "training") if not item.ram_ok]


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


def gpu_memory(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    need = int(cfg.get("minGpuMemoryGb", 0))
    return [(r.name, f"{t} has {item.gpu_vram_gb} GB per GPU; the workload needs >= {need} GB")
            for r, _, t, item in _types_of(resources, "training") if item.gpu_vram_gb < need]


INFERENCE_GPUS = ("T4", "A10", "A10G", "L4")


def inference_class(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r.name, f"inference group {c.group} runs on {item.gpu_model} ({t}); "
                     f"{'/'.join(INFERENCE_GPUS)} serve for less")
            for r, c, t, item in _types_of(resources, "inference") if item.gpu_model not in INFERENCE_GPUS]


# ------------------------------------------------------------------------------ security

def _ingress_sources(r: Res) -> tuple[str, list[str]] | None:
    """(the security group it opens, the source CIDRs it admits) of an ingress rule, on any cloud."""
    def cidrs(*values: Any) -> list[str]:
        out: list[str] = []
        for v in values:
            # lists arrive as the engine's list proxies in a real Analyze call, not as list
            out += [str(c) for c in v] if v and not isinstance(v, (str, bytes)) and hasattr(v, "__iter__") \
                else ([str(v)] if v else [])
        return out

    t = r.type
    if t == "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule":
        return str(r.get("securityGroupId")), cidrs(r.get("cidrIpv4"), r.get("cidrIpv6"))
    if t == "aws:ec2/securityGroupRule:SecurityGroupRule" and r.get("type") == "ingress":
        return str(r.get("securityGroupId")), cidrs(r.get("cidrBlocks"), r.get("ipv6CidrBlocks"))
    if t == "aws:ec2/securityGroup:SecurityGroup":
        return r.name, cidrs(*[c for i in (r.get("ingress") or []) for c in (i.get("cidrBlocks"), i.get("ipv6CidrBlocks"))])
    if t == "alicloud:ecs/securityGroupRule:SecurityGroupRule" and r.get("type") == "ingress" \
            and str(r.get("policy", default="accept")).lower() == "accept":
        return str(r.get("securityGroupId")), cidrs(r.get("cidrIp"), r.get("ipv6CidrIp"))
    if t == "tencentcloud:Security/groupRuleSet:GroupRuleSet":
        return str(r.get("securityGroupId")), cidrs(*[c for i in (r.get("ingresses") or [])
                                                      if str(i.get("action", "ACCEPT")).upper() == "ACCEPT"
                                                      for c in (i.get("cidrBlock"), i.get("ipv6CidrBlock"))])
    if t == "tencentcloud:Security/groupRule:GroupRule" and r.get("type") == "ingress" \
            and str(r.get("policy", default="ACCEPT")).upper() == "ACCEPT":
        return str(r.get("securityGroupId")), cidrs(r.get("cidrIp"))
    return None


def no_public_ingress(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Judged by the address space a security group admits, all its ingress rules together:
    0.0.0.0/1 plus 128.0.0.0/1 is the internet as surely as 0.0.0.0/0 (IPv6 alike)."""
    fix = "allow only your office / VPN CIDRs (networks[].sshCidrs) or use Session Manager / cloud shell"
    groups: dict[str, list[tuple[Res, list[str]]]] = {}
    for r in resources:
        found = _ingress_sources(r)
        if found and found[1]:
            groups.setdefault(found[0], []).append((r, found[1]))
    out = []
    for members in groups.values():
        everything = [c for _, cs in members for c in cs]
        if not opens_internet(everything):
            continue
        for r, cs in members:
            if opens_internet(cs):
                out.append((r.name, f"{r.type} admits traffic from the whole internet ({', '.join(cs)}); {fix}"))
            elif any(not _private(c) for c in cs):
                out.append((r.name, f"{r.type} and the other rules of its security group together admit the whole "
                                    f"internet ({', '.join(sorted(set(everything)))}); {fix}"))
    return out


def public_ingress_rule(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    """One security group or ingress rule resource, judged alone before it is created (the
    engine's per-resource Analyze during `pulumi up`): its own sources must not add up to the
    internet, IPv4 or IPv6, split ranges included (0.0.0.0/1 + 128.0.0.0/1, ::/1 + 8000::/1).
    Rules that open it only together, across resources, are no-public-ingress's (stack level)."""
    found = _ingress_sources(r)
    if not found or not found[1] or not opens_internet(found[1]):
        return []
    return [f"{r.type} admits traffic from the whole internet ({', '.join(found[1])}); allow only your office / "
            "VPN CIDRs (networks[].sshCidrs) or use Session Manager / cloud shell"]


def _private(cidr: str) -> bool:
    import ipaddress

    return ipaddress.ip_network(cidr, strict=False).is_private


AWS_METADATA = ("aws:ec2/launchTemplate:LaunchTemplate", "aws:ec2/instance:Instance")
ALI_METADATA = ("alicloud:ecs/instance:Instance", "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate")


def metadata_hardened(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    if r.type in AWS_METADATA and r.get("metadataOptions", "httpTokens") != "required":
        return ["instance metadata must require IMDSv2 tokens: metadataOptions.httpTokens = required"]
    if r.type in ALI_METADATA and r.get("httpTokens") != "required":
        return ["ECS metadata must be in hardened (token) mode: http_tokens = required"]
    return []


def harden_metadata(r: Res) -> dict[str, Any] | None:
    """The remediation: tokens required (nothing on the node reads metadata without one)."""
    props = dict(r.props)
    if r.type in AWS_METADATA:
        props["metadataOptions"] = {**dict(r.get("metadataOptions") or {}), "httpTokens": "required"}
        return props
    if r.type in ALI_METADATA:
        return {**props, "httpTokens": "required"}
    return None


PASSWORD_KEYS = ("password", "kmsEncryptedPassword")


def no_passwords(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    found = [k for k in PASSWORD_KEYS if r.get(k)] + [f"autoScalingConfig.{k}" for k in PASSWORD_KEYS
                                                     if r.get("autoScalingConfig", k)]
    if r.cloud in clouds.PASSWORD_CLOUDS and found:
        return [f"sets an instance password ({', '.join(found)}); use key pairs or session access, and Pulumi "
                "secrets for anything sensitive"]
    return []


def _aws_bucket_ids(resources: list[Res]) -> dict[str, Res]:
    return {str(r.get("bucket")): r for r in resources if r.type == "aws:s3/bucket:Bucket"} | {
        f"{r.name}-id": r for r in resources if r.type == "aws:s3/bucket:Bucket"}


def buckets_safe(resources: list[Res], cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = []
    aws_buckets = _aws_bucket_ids(resources)
    seen: dict[str, set[str]] = {b.name: set() for b in aws_buckets.values()}
    for r in resources:
        target = aws_buckets.get(str(r.get("bucket")))
        if target is None:
            continue
        if r.type == "aws:s3/bucketVersioning:BucketVersioning" and r.get("versioningConfiguration", "status") == "Enabled":
            seen[target.name].add("versioned")
        if r.type.startswith("aws:s3/bucketServerSideEncryptionConfiguration") and r.get("rules"):
            seen[target.name].add("encrypted")
        if r.type == "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock" and all(
                r.get(k) is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")):
            seen[target.name].add("private")
    for name, props in seen.items():
        missing = {"versioned", "encrypted", "private"} - props
        if missing:
            out.append((name, f"S3 bucket is not {', '.join(sorted(missing))}: add BucketVersioning (Enabled), "
                              "server-side encryption and a full public access block"))
    for r in resources:
        lacks: list[str] = []
        if r.type == "alicloud:oss/bucket:Bucket":
            if r.get("versioning", "status") != "Enabled":
                lacks.append("versioned")
            if not r.get("serverSideEncryptionRule", "sseAlgorithm"):
                lacks.append("encrypted")
            if r.get("acl", default="private") != "private":
                lacks.append("private")
        elif r.type == "tencentcloud:Cos/bucket:Bucket":
            if r.get("versioningEnable") is not True:
                lacks.append("versioned")
            if not r.get("encryptionAlgorithm"):
                lacks.append("encrypted")
            if r.get("acl", default="private") != "private":
                lacks.append("private")
        if lacks:
            out.append((r.name, f"bucket is not {', '.join(lacks)}; enable versioning, server-side encryption "
                                "and a private ACL"))
    return out


def _disks_apply(r: Res, dd: clouds.DataDisks) -> bool:
    """Whether the cloud's data-disk check reads this resource: the SDK can express the flag
    here (where it may not), else the resource lists data disks."""
    if dd.sdk_gap_possible:
        return not sdk_gap(r.type, "dataDiskEncryption")
    return r.get("dataDisks") is not None


def _disks_fixable(r: Res, dd: clouds.DataDisks) -> bool:
    if dd.sdk_gap_possible:
        return bool(r.get("dataDisks")) and not sdk_gap(r.type, "dataDiskEncryption")
    return r.get("dataDisks") is not None


def disks_encrypted(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    bad = False
    if r.type == "aws:ec2/launchTemplate:LaunchTemplate":
        bad = any(str((m.get("ebs") or {}).get("encrypted")).lower() != "true"
                  for m in (r.get("blockDeviceMappings") or []) if m.get("ebs"))
    elif r.type == "aws:ebs/volume:Volume":
        bad = r.get("encrypted") is not True
    elif (dd := clouds.data_disks(r.cloud)) is not None and _disks_apply(r, dd):
        disks = r.get("dataDisks") or (r.get("autoScalingConfig", "dataDisks") if dd.sdk_gap_possible else None) or []
        bad = any(not dd.is_encrypted(d.get(dd.key)) for d in disks)
    elif r.type == "aws:efs/fileSystem:FileSystem":
        bad = r.get("encrypted") is not True
    elif r.type == "alicloud:nas/fileSystem:FileSystem":
        bad = r.get("encryptType", default=0) not in (1, 2)  # 1.0 == 1: numbers arrive as floats
    return ["a disk or file system is not encrypted; set encrypted / encrypt on every data and root disk, "
            "encrypted on EFS, encryptType 1 on NAS"] if bad else []


def encrypt_disks(r: Res) -> dict[str, Any] | None:
    """The remediation: every disk of the resource encrypted (with the cloud's default key)."""
    props = dict(r.props)
    if r.type == "aws:ec2/launchTemplate:LaunchTemplate":
        props["blockDeviceMappings"] = [{**m, "ebs": {**m["ebs"], "encrypted": "true"}} if m.get("ebs") else m
                                        for m in (r.get("blockDeviceMappings") or [])]
    elif r.type in ("aws:ebs/volume:Volume", "aws:efs/fileSystem:FileSystem"):
        props["encrypted"] = True
    elif r.type == "alicloud:nas/fileSystem:FileSystem":
        props["encryptType"] = 1
    elif (dd := clouds.data_disks(r.cloud)) is not None and _disks_fixable(r, dd):
        props["dataDisks"] = [{**d, dd.key: True} for d in r.get("dataDisks") or []]
    else:
        return None
    return props


def known_sdk_gaps(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    """Security settings the pinned SDKs cannot express, on the resources that need them."""
    reason = sdk_gap(r.type, "dataDiskEncryption")
    found = [f"data disks are not encrypted: {reason}"] if reason and r.get("dataDisks") else []
    at_rest = sdk_gap(r.type, "atRestEncryption")
    return found + ([f"the shared file system is not encrypted at rest: {at_rest}"] if at_rest else [])


def private_kubernetes_api(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    """An API endpoint may be public only when restricted to known sources: EKS by
    publicAccessCidrs that do not add up to the internet, TKE by a security group of its own.
    ACK has no such control the provider can set, so its endpoint must stay private."""
    open_to = ""
    if r.type == "aws:eks/cluster:Cluster" and r.get("vpcConfig", "endpointPublicAccess", default=True):
        cidrs = r.get("vpcConfig", "publicAccessCidrs") or ["0.0.0.0/0"]
        open_to = "the internet" if opens_internet(cidrs) else ""
    elif r.type == "alicloud:cs/managedKubernetes:ManagedKubernetes" and r.get("slbInternetEnabled", default=True):
        open_to = "any source (ACK's API access list cannot be set by the provider)"
    elif r.type == "tencentcloud:Kubernetes/clusterEndpoint:ClusterEndpoint" and r.get("clusterInternet"):
        open_to = "" if r.get("clusterInternetSecurityGroup") else "any source (no security group)"
    elif r.type == "tencentcloud:Kubernetes/cluster:Cluster" and r.get("clusterInternet"):
        open_to = "any source (use a ClusterEndpoint with a security group)"
    if not open_to:
        return []
    return [f"the Kubernetes API endpoint is open to {open_to}; keep it private or list the operators' CIDRs in "
            "kubernetes.apiAccessCidrs"]


# ------------------------------------------------------------------------------- tagging

REQUIRED_TAGS = ("owner", "cost-center", "env")


def required_tags(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    need = list(cfg.get("tags") or REQUIRED_TAGS)
    if not taggable(r.type):
        return []
    missing = [t for t in need if not tags_of(r).get(t)]
    return [f"{r.type} lacks tag(s) {', '.join(missing)}; the stack's tags must reach it"] if missing else []


@functools.lru_cache(maxsize=1)
def _stateful() -> Mapping[str, str]:
    """type -> why it is protected (policies/data/stateful.yaml, a copy of infra/data/'s); read
    once per process, not once per resource (the rule runs on every resource of the plan)."""
    import yaml

    data = yaml.safe_load((cat.DATA_DIR / "stateful.yaml").read_text(encoding="utf-8"))
    return {t: str(v["why"]) for t, v in data["types"].items()}


def stateful_protected(r: Res, config: Mapping[str, Any]) -> list[str]:
    stateful = _stateful()
    if r.type not in stateful or r.protect:
        return []
    return [f"{r.type} is not protected, and it holds {stateful[r.type]}: a destroy or a replacement would take "
            "it. Register it with protect=True (infra/protection.py does for every type in "
            "infra/data/stateful.yaml), or set protectStateful: true"]


RULES: list[Rule] = [
    Rule("stack-cost-cap", "The stack's GPU capacity at its maximum stays under an hourly and monthly cap.",
         "mandatory", stack_cost_cap, {"maxHourlyUsd": {"type": "number"}, "maxMonthlyUsd": {"type": "number"},
                                        "cnyPerUsd": {"type": "number"}, "groupPrices": {"type": "object"}}),
    Rule("node-group-cost-cap", "Each node group at its maximum stays under an hourly cap.", "mandatory",
         group_cost_cap, {"maxHourlyUsdPerGroup": {"type": "number"}, "cnyPerUsd": {"type": "number"},
                          "groupPrices": {"type": "object"}}),
    Rule("budget-covers-plan", "The planned monthly cost stays within the stack's budget.", "mandatory",
         budget_covers_plan, BUDGET_SCHEMA),
    Rule("budget-headroom", "The planned monthly cost stays under the budget's first alert threshold.", "advisory",
         budget_headroom, BUDGET_SCHEMA),
    Rule("prices-fresh", "The prices the stack's costs and caps rest on are younger than maxAgeDays (90).",
         "advisory", prices_fresh, PRICES_SCHEMA),
    Rule("gpu-spot-only", "All GPU capacity is spot (dev).", "disabled", spot_only),
    Rule("gpu-families-allowed", "GPU instance families are on the environment's list.", "mandatory",
         schema={"families": {"type": "array", "items": {"type": "string"}}}, per_resource=allowed_families),
    Rule("gpu-max-nodes", "Node groups cannot grow past a cap.", "mandatory", max_nodes,
         {"maxNodesPerGroup": {"type": "integer"}}),
    Rule("team-gpu-quota", "A team stack's GPUs at their maximum stay within the team's quota per cloud and model "
         "(teams.yaml).", "mandatory", team_gpu_quota,
         {"team": {"type": "string"}, "gpuQuota": {"type": "object"}}),
    Rule("team-markets", "A spot-only team keeps no more on-demand nodes than its registry entry allows.",
         "mandatory", team_markets,
         {"team": {"type": "string"}, "spotOnly": {"type": "boolean"}, "onDemandBaseMax": {"type": "integer"}}),
    Rule("reserve-always-on", "Always-on on-demand capacity should be reserved or under a savings plan.",
         "advisory", reserve_always_on),
    Rule("host-ram-ratio", "Training hosts have RAM >= 1.5 x total GPU memory.", "mandatory", host_ram),
    Rule("training-dataset-disk", "Training nodes have >= 1 TB of NVMe or data disk for datasets.", "mandatory",
         dataset_disk, {"minGb": {"type": "integer"}}),
    Rule("gpu-memory-minimum", "GPUs have at least the workload's minimum memory.", "mandatory", gpu_memory,
         {"minGpuMemoryGb": {"type": "integer"}}),
    Rule("inference-gpu-class", "Inference runs on inference-class GPUs (T4 / A10 / L4).", "advisory",
         inference_class),
    Rule("stateful-protected", "Buckets, keys, clusters and registries are protected from destroy and replacement "
         "(prod).", "disabled", per_resource=stateful_protected),
    Rule("no-public-ingress", "No ingress from 0.0.0.0/0, for SSH, RDP or anything else.", "mandatory",
         no_public_ingress),
    Rule("no-public-ingress-rule", "No security group or ingress rule resource admits the internet (IPv4 or IPv6, "
         "split ranges included), judged on each before it is created.", "mandatory",
         per_resource=public_ingress_rule),
    Rule("metadata-hardened", "Instance metadata requires tokens (IMDSv2 / hardened mode).", "mandatory",
         per_resource=metadata_hardened, remediate=harden_metadata),
    Rule("no-instance-passwords", "No instance passwords.", "mandatory", per_resource=no_passwords),
    Rule("buckets-private-encrypted-versioned", "Buckets are private, encrypted and versioned.", "mandatory",
         buckets_safe),
    Rule("disks-encrypted", "Every disk and shared file system is encrypted.", "mandatory", per_resource=disks_encrypted,
         remediate=encrypt_disks),
    Rule("known-sdk-gaps", "Security settings the provider SDKs cannot express yet (with the workaround).",
         "advisory", per_resource=known_sdk_gaps),
    Rule("kubernetes-api-private", "Kubernetes API endpoints are not public (prod).", "disabled",
         per_resource=private_kubernetes_api),
    Rule("required-tags", "owner, cost-center and env on every taggable resource.", "mandatory",
         schema={"tags": {"type": "array", "items": {"type": "string"}}}, per_resource=required_tags),
]


def configured(rule: Rule, config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(enforcement level, settings) of a rule in a policy-pack config file's content:
    {rule: "mandatory" | "advisory" | "remediate" | "disabled" | {"enforcementLevel": ..., <settings>}}."""
    entry = config.get(rule.name, {})
    settings = dict(entry) if isinstance(entry, Mapping) else {"enforcementLevel": entry}
    level = str(settings.pop("enforcementLevel", rule.enforcement))
    return level, settings


def evaluate(resources: list[Res], config: Mapping[str, Any]) -> list[dict[str, str]]:
    """Run every enabled rule, as the engine would with this config."""
    found = []
    for rule in RULES:
        level, settings = configured(rule, config)
        if level == "disabled":
            continue
        if level == "remediate" and rule.remediate is None:
            level = "mandatory"  # as the engine treats a policy without a remediation
        for resource, message in rule.run(resources, settings):
            if level == "remediate":
                message += " (remediated: the engine applies the fix before the resource is created)"
            found.append({"policy": rule.name, "enforcement": level, "resource": resource, "message": message})
    return found


# ---------------------------------------------------------------- API access sources (issue 27)

# Ranges no operator or CI runner can come from on the internet: documentation (RFC 5737:
# 192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24; RFC 3849: 2001:db8::/32), private use (RFC 1918),
# shared address space (RFC 6598), loopback, link-local (RFC 3927) and benchmarking (RFC 2544).
UNROUTABLE_SOURCES = {
    "192.0.2.0/24": "documentation (RFC 5737)", "198.51.100.0/24": "documentation (RFC 5737)",
    "203.0.113.0/24": "documentation (RFC 5737)", "2001:db8::/32": "documentation (RFC 3849)",
    "10.0.0.0/8": "private use (RFC 1918)", "172.16.0.0/12": "private use (RFC 1918)",
    "192.168.0.0/16": "private use (RFC 1918)", "100.64.0.0/10": "shared address space (RFC 6598)",
    "127.0.0.0/8": "loopback (RFC 1122)", "169.254.0.0/16": "link-local (RFC 3927)",
    "198.18.0.0/15": "benchmarking (RFC 2544)", "fc00::/7": "unique local (RFC 4193)",
}
# Rules whose offline verdict is advisory whatever the pack config says: the offline plan of a
# shipped example stack must plan, while a real preview with the pack refuses it.
OFFLINE_ADVISORY = ("kubernetes-api-sources-routable",)


def _api_sources(r: Res) -> list[str]:
    """The public sources of the Kubernetes API endpoints and of the registries' push endpoints
    (kubernetes.apiAccessCidrs): EKS publicAccessCidrs, TKE's API security group rules, ACR's
    internet endpoint entries, TCR's security policies."""
    if r.type == "aws:eks/cluster:Cluster":
        return list(r.get("vpcConfig", "publicAccessCidrs") or [])
    if r.type == "tencentcloud:Security/groupRuleSet:GroupRuleSet":
        return [str(i["cidrBlock"]) for i in r.get("ingresses") or []
                if isinstance(i, Mapping) and i.get("description") == "Kubernetes API" and i.get("cidrBlock")]
    if r.type == "alicloud:cr/internetEndpoint:InternetEndpoint":
        return [str(e["entry"]) for e in r.get("entries") or [] if isinstance(e, Mapping) and e.get("entry")]
    if r.type == "tencentcloud:Tcr/instance:Instance":
        return [str(p["cidrBlock"]) for p in r.get("securityPolicies") or [] if isinstance(p, Mapping) and p.get("cidrBlock")]
    return []


def api_sources_routable(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    import ipaddress

    found = []
    for cidr in _api_sources(r):
        try:
            net = ipaddress.ip_network(str(cidr), strict=False)
        except ValueError:
            continue
        for reserved, why in UNROUTABLE_SOURCES.items():
            if net.version == ipaddress.ip_network(reserved).version and net.overlaps(ipaddress.ip_network(reserved)):
                found.append(f"{cidr} is a {why} range: no operator or CI runner reaches the endpoint from it, so "
                             "`pulumi up` cannot reach the cluster or push the image; set kubernetes.apiAccessCidrs "
                             "to your operators' and runners' public egress ranges")
                break
    return found


RULES.append(Rule(
    "kubernetes-api-sources-routable", "Kubernetes API and registry push endpoints admit real public sources, not "
    "documentation or private-use ranges (kubernetes.apiAccessCidrs).", "mandatory",
    per_resource=api_sources_routable))
