"""The rules: cost, spot, hardware, security and tagging. Each is a function over all of the
stack's resources (a cloud-neutral `Res` view) and its config, returning violations that name
the resource, the rule and the fix. Specs and prices come from the stack's own GPU catalog.

The checks live by topic (rules_cost.py: cost, spot and hardware; rules_security.py: security;
tagging and protection here); this module lists them as RULES and evaluates them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import catalog as cat
from .resources import Res, tags_of, taggable
from .rules_cost import (
    RAM_PER_VRAM, SCHEDULES, stack_cost_cap, group_cost_cap, BUDGET_SCHEMA, budget_covers_plan, budget_headroom,
    PRICES_SCHEMA, prices_fresh, spot_only, allowed_families, max_nodes, gpu_usage, team_gpu_quota, team_markets,
    reserve_always_on, host_ram, dataset_disk, gpu_memory, INFERENCE_GPUS, inference_class, SPARES_SCHEMA,
    spares_share)
from .rules_security import (
    sdk_gap, no_public_ingress, public_ingress_rule, AWS_METADATA, ALI_METADATA, metadata_hardened, harden_metadata,
    PASSWORD_KEYS, no_passwords, buckets_safe, disks_encrypted, encrypt_disks, known_sdk_gaps,
    private_kubernetes_api, UNROUTABLE_SOURCES, api_sources_routable)

__all__ = ["Violation", "Rule", "RULES", "configured", "evaluate", "OFFLINE_ADVISORY", "REQUIRED_TAGS",
           "required_tags", "stateful_protected", "RAM_PER_VRAM", "SCHEDULES", "stack_cost_cap", "group_cost_cap", "BUDGET_SCHEMA", "budget_covers_plan",
           "budget_headroom", "PRICES_SCHEMA", "prices_fresh", "spot_only", "allowed_families", "max_nodes",
           "gpu_usage", "team_gpu_quota", "team_markets", "reserve_always_on", "host_ram", "dataset_disk",
           "gpu_memory", "INFERENCE_GPUS", "inference_class", "SPARES_SCHEMA", "spares_share", "sdk_gap", "no_public_ingress", "public_ingress_rule",
           "AWS_METADATA", "ALI_METADATA", "metadata_hardened", "harden_metadata", "PASSWORD_KEYS", "no_passwords",
           "buckets_safe", "disks_encrypted", "encrypt_disks", "known_sdk_gaps", "private_kubernetes_api",
           "UNROUTABLE_SOURCES", "api_sources_routable"]


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
    Rule("gpu-spares-share", "Warm spares (scaling.spares) stay within one per nodesPerSpare (8) nodes of the run; "
         "the message weighs their cost against the run's expected member losses.", "mandatory", spares_share,
         SPARES_SCHEMA),
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


# Rules whose offline verdict is advisory whatever the pack config says: the offline plan of a
# shipped example stack must plan, while a real preview with the pack refuses it.
OFFLINE_ADVISORY = ("kubernetes-api-sources-routable",)



RULES.append(Rule(
    "kubernetes-api-sources-routable", "Kubernetes API and registry push endpoints admit real public sources, not "
    "documentation or private-use ranges (kubernetes.apiAccessCidrs).", "mandatory",
    per_resource=api_sources_routable))


from .rules_capacity import SCHEMA as CAPACITY_SCHEMA, candidates_capped  # noqa: E402

RULES.append(Rule(
    "capacity-candidates-capped", "A node group's capacity candidates cost at most maxRatio (1.5) x its declared "
    "place at its maximum size, and buy no on-demand nodes unless allowOnDemand.", "mandatory", candidates_capped,
    CAPACITY_SCHEMA))
