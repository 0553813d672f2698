"""The stack spec: one typed, validated description of a stack, read from Pulumi config once.

Every cloud implementation reads this model and nothing else. Shape and ranges are checked by
pydantic; cross-field rules (catalog, regions, CIDRs, account-site markets) by `check()`.
Both report key paths in the stack file's own spelling (camelCase), e.g.
`nodeGroups[1].instanceType`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import Annotated, Any, Literal

from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from infra import catalog as cat
from infra.errors import Problem, SpecError, suggest
from infra.schedule import cron_in_beijing

Cloud = Literal["aws", "alicloud", "tencentcloud"]
NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
PATTERN_HELP = {
    NAME_PATTERN: "use 2-32 lowercase letters, digits and hyphens, starting with a letter",
    r"^\d{6,12}$": "use the numeric APPID from the Tencent Cloud console",
}

# The top-level Pulumi config keys (namespace gpu-training-stack), in the order documented.
CONFIG_KEYS = ("env", "tags", "clouds", "networks", "peerings", "nodeGroups", "storage",
               "training", "budget", "pricing")
REQUIRED_TAGS = ("owner", "cost-center", "env")


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)


class Mirrors(Model):
    """Package and image mirrors for nodes that cannot reach Docker Hub, nvcr.io or PyPI."""

    registry: str | None = Field(None, description="Container registry mirror host, e.g. registry.cn-hangzhou.aliyuncs.com.")
    apt: str | None = Field(None, description="APT mirror base URL for Ubuntu images.")
    yum: str | None = Field(None, description="YUM mirror base URL for Alibaba Cloud Linux / TencentOS.")
    pip: str | None = Field(None, description="PyPI index URL.")


class CloudAccount(Model):
    """One cloud account the stack deploys into."""

    region: str = Field(description="Default region; networks without a region use it.")
    site: Literal["china", "international"] = Field(
        "international", description="Account site; decides which markets it can buy.")
    app_id: str | None = Field(None, pattern=r"^\d{6,12}$",
                               description="Tencent Cloud APPID, suffix of COS bucket names.")
    mirrors: Mirrors = Field(default_factory=Mirrors, description="Mirrors the nodes use.")


class Subnet(Model):
    zone: str = Field(description="Availability zone, e.g. us-east-1a, cn-hangzhou-h, ap-guangzhou-3.")
    cidr: IPv4Network = Field(description="Subnet CIDR, inside the network's CIDR.")


class Network(Model):
    """A VPC with subnets (vSwitches) in one region."""

    name: Name = Field(description="Unique name; node groups and peerings refer to it.")
    cloud: Cloud = Field(description="Cloud the VPC lives in.")
    region: str | None = Field(None, description="Region; defaults to the cloud's region.")
    purpose: Literal["training", "data", "inference"] = Field("training", description="What the VPC holds.")
    cidr: IPv4Network = Field(description="VPC CIDR.")
    subnets: list[Subnet] = Field(min_length=1, description="Private subnets, one per zone.")
    nat: bool = Field(False, description="Create a NAT gateway for egress.")
    ssh_cidrs: list[IPv4Network] = Field(default_factory=list,
                                         description="CIDRs allowed to SSH in; empty = no SSH (use SSM / cloud shell).")


class Peering(Model):
    """A private link between two networks of one cloud."""

    name: Name = Field(description="Unique name of the link.")
    requester: str = Field(description="Network that asks for the peering.")
    accepter: str = Field(description="Network that accepts it.")
    via: Literal["peering", "transit"] = Field(
        "peering", description="peering: VPC peering; transit: CEN (Alibaba) / CCN (Tencent) / Transit Gateway (AWS).")
    bandwidth_mbps: int | None = Field(None, gt=0, description="Cross-region bandwidth cap (Alibaba, Tencent).")


class GpuRequirement(Model):
    """A GPU requirement the selector turns into instance types."""

    model: str | None = Field(None, description="GPU model, e.g. A100, H100, V100, A10, T4, L4.")
    min_vram_gb: int = Field(0, ge=0, description="Minimum memory per GPU in GB.")
    count: int = Field(1, ge=1, description="GPUs per node.")


class Scaling(Model):
    min: int = Field(ge=0, description="Fewest nodes.")
    max: int = Field(ge=1, description="Most nodes.")
    desired: int | None = Field(None, ge=0, description="Nodes at rest; defaults to min.")

    @property
    def baseline(self) -> int:
        return self.min if self.desired is None else self.desired


class Market(Model):
    """How the nodes are bought."""

    type: Literal["spot", "on-demand", "reserved"] = Field(description="Purchase market.")
    on_demand_base: int = Field(0, ge=0, description="With spot: nodes kept on-demand; the rest are spot.")
    spot_max_price_usd: float | None = Field(None, gt=0, description="With spot: price cap per node-hour; none = up to on-demand.")


class ScheduleAction(Model):
    """A recurring scaling action (UTC cron), e.g. training pools down at night."""

    name: Name = Field(description="Action name.")
    cron: str = Field(description="Five-field cron expression, UTC.")
    desired: int = Field(ge=0, description="Desired nodes from this time on.")
    min: int | None = Field(None, ge=0, description="New minimum, if it changes.")
    max: int | None = Field(None, ge=0, description="New maximum, if it changes.")


class Scratch(Model):
    size_gb: int = Field(0, ge=0, description="Scratch space per node for datasets, GB.")
    source: Literal["auto", "instance-store", "data-disk"] = Field(
        "auto", description="instance-store: local NVMe only; data-disk: encrypted cloud disk; auto: NVMe when big enough.")


class NodeGroup(Model):
    """GPU nodes: a VM fleet or a managed-Kubernetes node pool."""

    name: Name = Field(description="Unique name.")
    cloud: Cloud = Field(description="Cloud of the nodes.")
    network: str = Field(description="Network (by name) the nodes join.")
    kind: Literal["vm", "kubernetes"] = Field("vm", description="vm: instance fleet; kubernetes: EKS/ACK/TKE node pool.")
    workload: Literal["training", "inference"] = Field("training", description="What runs on the nodes.")
    instance_type: str | None = Field(None, description="Instance type; or give `gpu` and let the selector choose.")
    fallback_types: list[str] = Field(default_factory=list, description="More types for spot capacity pools.")
    gpu: GpuRequirement | None = Field(None, description="GPU requirement instead of an instance type.")
    min_gpu_memory_gb: int = Field(0, ge=0, description="Smallest GPU memory the workload runs in (e.g. 32 for 3D detection).")
    scaling: Scaling = Field(description="Node counts.")
    market: Market = Field(description="Purchase market.")
    schedule: list[ScheduleAction] = Field(default_factory=list, description="Recurring scaling actions.")
    scratch: Scratch | None = Field(None, description="Scratch space; defaults to storage.scratch.")

    @model_validator(mode="after")
    def _type_or_requirement(self) -> NodeGroup:
        if (self.instance_type is None) == (self.gpu is None):
            raise ValueError("give exactly one of instanceType or gpu (a requirement)")
        return self


class Storage(Model):
    bucket_prefix: Name = Field(description="Bucket name prefix; each cloud adds its suffix.")
    scratch: Scratch = Field(default_factory=Scratch, description="Default scratch for node groups.")
    checkpoint_archive_days: int = Field(30, ge=1, description="Days before checkpoints move to archive storage.")
    noncurrent_expire_days: int = Field(30, ge=1, description="Days before old object versions are deleted.")
    abort_multipart_days: int = Field(7, ge=1, description="Days before incomplete multipart uploads are aborted.")
    expected_gb: int = Field(500, ge=0, description="Bucket size used for the cost summary.")
    dataset_tmpfs_gb: int = Field(0, ge=0, description="Also cache the dataset in RAM (tmpfs) of this size; 0 = off.")


class Training(Model):
    image: str = Field(description="Training container image (pinned tag or digest).")
    launcher: Literal["torchrun", "accelerate", "horovod"] = Field("torchrun", description="Distributed launcher.")
    workload: Literal["resnet50", "tiny"] = Field("resnet50", description="Workload the bootstrap trains.")
    checkpoint_every: int = Field(500, gt=0, description="Checkpoint every N steps (and on SIGTERM).")
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept locally and in the bucket.")
    dataset_url: str = Field(description="Dataset location (s3://, oss://, cosn://, file://).")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow server, if any.")
    rendezvous_endpoint: str | None = Field(
        None, pattern=r"^[A-Za-z0-9.-]+:\d+$",
        description="host:port of the c10d rendezvous for multi-node VM fleets (e.g. a fixed private IP or DNS name).")


class Budget(Model):
    monthly_limit_usd: float = Field(gt=0, description="Monthly spending limit, USD.")
    alert_emails: list[Annotated[str, Field(pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$")]] = Field(
        min_length=1, description="Who gets budget alerts.")
    thresholds_percent: list[Annotated[int, Field(gt=0, le=200)]] = Field(
        default_factory=lambda: [50, 80, 100], description="Alert at these percentages of the limit.")


class PriceOverride(Model):
    cloud: Cloud
    instance_type: str
    on_demand_hourly: float = Field(gt=0, description="Price per node-hour in the catalog row's currency.")


class Pricing(Model):
    cny_per_usd: float = Field(7.2, gt=0, description="Exchange rate for CNY catalog prices.")
    overrides: list[PriceOverride] = Field(default_factory=list, description="Negotiated or current prices.")


class StackSpec(Model):
    """Everything a stack is: clouds, networks, GPU node groups, storage, training, budget, tags."""

    env: Name = Field(description="Environment name: dev, prod, or a team's own.")
    tags: dict[str, str] = Field(description="Tags on every taggable resource; owner, cost-center, env required.")
    clouds: dict[Cloud, CloudAccount] = Field(min_length=1, description="Cloud accounts to deploy into.")
    networks: list[Network] = Field(min_length=1, description="VPCs.")
    peerings: list[Peering] = Field(default_factory=list, description="Links between VPCs.")
    node_groups: list[NodeGroup] = Field(min_length=1, description="GPU node groups.")
    storage: Storage = Field(description="Bucket and scratch settings.")
    training: Training = Field(description="The training job.")
    budget: Budget = Field(description="Monthly budget and alerts.")
    pricing: Pricing = Field(default_factory=Pricing, description="Exchange rate and price overrides.")

    # Derived lookups -----------------------------------------------------------------
    def network(self, name: str) -> Network:
        return next(n for n in self.networks if n.name == name)

    def region_of(self, net: Network) -> str:
        return net.region or self.clouds[net.cloud].region

    def scratch_of(self, group: NodeGroup) -> Scratch:
        return group.scratch or self.storage.scratch

    def catalog(self) -> cat.Catalog:
        overrides: dict[tuple[str, str], float] = {
            (o.cloud, o.instance_type): o.on_demand_hourly for o in self.pricing.overrides}
        return cat.load_catalog().with_prices(overrides)

    def requirement(self, group: NodeGroup) -> cat.Requirement:
        scratch = self.scratch_of(group)
        gpu = group.gpu or GpuRequirement()
        return cat.Requirement(gpu_count=gpu.count, gpu_model=gpu.model,
                               min_vram_gb=max(gpu.min_vram_gb, group.min_gpu_memory_gb),
                               scratch_gb=scratch.size_gb, scratch_source=scratch.source)

    def instance_types(self, group: NodeGroup) -> list[str]:
        """The group's instance types, preferred first: the named type or the selector's picks."""
        if group.instance_type is not None:
            types = [group.instance_type] + group.fallback_types
        else:
            picks = cat.select(self.catalog(), [group.cloud], self.requirement(group),
                               self.pricing.cny_per_usd)
            types = [c.type.instance_type for c in picks[:4]] + group.fallback_types
        return list(dict.fromkeys(types))


@dataclass(frozen=True)
class Hardware:
    """What a node group runs on: its instance types (preferred first), the catalog row of the
    first, and the data disk each node needs for scratch (0 when local NVMe holds it)."""

    types: list[str]
    primary: cat.InstanceType
    scratch_disk_gb: int


def hardware(spec: StackSpec, group: NodeGroup) -> Hardware:
    types = spec.instance_types(group)
    primary = spec.catalog().get(group.cloud, types[0])
    if primary is None:  # parse() has checked every type against the catalog
        raise LookupError(f"{group.name}: {types[0]} is not in the catalog")
    scratch = spec.scratch_of(group)
    return Hardware(types, primary, cat.scratch_disk_gb(primary, scratch.size_gb, scratch.source) or 0)


def spot_price_cap(spec: StackSpec, group: NodeGroup, item: cat.InstanceType) -> float | None:
    """The group's spot price cap (spotMaxPriceUsd) in the currency its clouds bill in: the
    catalog row's currency, so CNY for Alibaba and Tencent types."""
    cap = group.market.spot_max_price_usd
    if cap is None:
        return None
    return round(cap if item.currency == "USD" else cap * spec.pricing.cny_per_usd, 4)


# --------------------------------------------------------------------------------------
# Loading and error reporting
# --------------------------------------------------------------------------------------

def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("function-after") or part in ("str", "int", "[key]"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """Aliases of the model fields allowed where an unknown key was found."""
    model: Any = StackSpec
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return []
        model = _model_of(field.annotation)
    return [f.alias or n for n, f in model.model_fields.items()] if model else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found:
            return found
    return None


def _problem(err: Any) -> Problem:
    loc = tuple(err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _fields_at(loc)
        return Problem(_path(loc), f"unknown key{suggest(loc[-1], allowed)} "
                                   f"Allowed here: {', '.join(allowed)}.")
    if kind == "missing":
        return Problem(_path(loc), "is required but missing; add it to the stack config")
    if kind in ("literal_error", "enum"):
        expected = re.findall(r"'([^']+)'", str(err.get("ctx", {}).get("expected", "")))
        return Problem(_path(loc), f"{value!r} is not allowed; use one of {', '.join(expected)}"
                                   f"{suggest(value, expected)}")
    msg = str(err["msg"]).removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":
        pattern = str(err.get("ctx", {}).get("pattern", ""))
        msg = f"is not a valid value; {PATTERN_HELP.get(pattern, msg)}"
    shown = "" if isinstance(value, (dict, list)) or value is None else f"{value!r}: "
    return Problem(_path(loc), f"{shown}{msg}")


def parse(raw: Mapping[str, Any], source: str = "stack config") -> StackSpec:
    """Build and fully check a StackSpec from config values; raise SpecError listing every problem."""
    unknown = [k for k in raw if k not in CONFIG_KEYS]
    problems = [Problem(k, f"unknown config key{suggest(k, CONFIG_KEYS)} Known keys: {', '.join(CONFIG_KEYS)}.")
                for k in unknown]
    try:
        spec = StackSpec.model_validate({k: v for k, v in raw.items() if k in CONFIG_KEYS})
    except ValidationError as exc:
        problems += [_problem(e) for e in exc.errors()]
        raise SpecError(problems, source) from None
    problems += check(spec)
    if problems:
        raise SpecError(problems, source)
    return spec


# --------------------------------------------------------------------------------------
# Cross-field checks
# --------------------------------------------------------------------------------------

def check(spec: StackSpec) -> list[Problem]:
    """Rules that span fields or need the catalog and region data."""
    problems: list[Problem] = []
    problems += _check_tags(spec)
    problems += _check_clouds(spec)
    nets = _check_networks(spec, problems)
    problems += _check_peerings(spec, nets)
    problems += _check_node_groups(spec, nets)
    return problems


def _check_tags(spec: StackSpec) -> list[Problem]:
    out = [Problem(f"tags.{t}", f"required tag is missing; add tags: {{{t}: ...}}")
           for t in REQUIRED_TAGS if not spec.tags.get(t)]
    if spec.tags.get("env") and spec.tags["env"] != spec.env:
        out.append(Problem("tags.env", f"{spec.tags['env']!r} differs from env {spec.env!r}; make them equal"))
    return out


def _check_region(cloud: str, region: str, path: str) -> list[Problem]:
    regions = cat.load_regions()[cloud]
    if region in regions:
        return []
    return [Problem(path, f"{region!r} is not a region of {cat.CLOUD_NAMES[cloud]} known here"
                          f"{suggest(region, regions)} Known: {', '.join(regions)} "
                          f"(add others to infra/data/regions.yaml).")]


def _check_clouds(spec: StackSpec) -> list[Problem]:
    out: list[Problem] = []
    for cloud, acct in spec.clouds.items():
        out += _check_region(cloud, acct.region, f"clouds.{cloud}.region")
        if cloud == "tencentcloud" and acct.app_id is None:
            out.append(Problem("clouds.tencentcloud.appId", "is required: COS bucket names end in -<APPID>; "
                                                            "find it under Account Info in the Tencent Cloud console"))
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
            problems += _check_region(net.cloud, region, f"{path}.region")
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
        for k, cidr in enumerate(net.ssh_cidrs):
            if cidr.prefixlen == 0:
                problems.append(Problem(f"{path}.sshCidrs[{k}]", "0.0.0.0/0 opens SSH to the internet; "
                                                                 "list your office or VPN CIDRs, or leave it empty"))
    return nets


def _check_peerings(spec: StackSpec, nets: Mapping[str, Network]) -> list[Problem]:
    out: list[Problem] = []
    seen: set[str] = set()
    for i, peer in enumerate(spec.peerings):
        path = f"peerings[{i}]"
        if peer.name in seen:
            out.append(Problem(f"{path}.name", f"{peer.name!r} is used by another peering"))
        seen.add(peer.name)
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
        out += _check_hardware(spec, catalog, group, path)
    return out


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
        if group.cloud == "tencentcloud" and croniter.is_valid(act.cron):
            try:
                cron_in_beijing(act.cron)
            except ValueError as exc:
                out.append(Problem(f"{apath}.cron", f"{exc}; Tencent AS runs schedules in Beijing time"))
        lo = s.min if act.min is None else act.min
        hi = s.max if act.max is None else act.max
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
    if m.type != "spot" and (m.on_demand_base or m.spot_max_price_usd is not None):
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


def _check_hardware(spec: StackSpec, catalog: cat.Catalog, group: NodeGroup, path: str) -> list[Problem]:
    out: list[Problem] = []
    if group.instance_type is not None:
        out += _check_type(catalog, group.cloud, group.instance_type, f"{path}.instanceType")
    for k, name in enumerate(group.fallback_types):
        out += _check_type(catalog, group.cloud, name, f"{path}.fallbackTypes[{k}]")
    if out:
        return out
    req = spec.requirement(group)
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
                                           f"({req.scratch_source}); relax the requirement")]
        return []
    for k, name in enumerate([group.instance_type or ""] + group.fallback_types):
        item = catalog.get(group.cloud, name)
        assert item is not None
        where = f"{path}.instanceType" if k == 0 else f"{path}.fallbackTypes[{k - 1}]"
        if group.workload == "training" and not item.ram_ok:
            out.append(Problem(where, f"{name} has {item.ram_gib} GiB RAM for {item.total_vram_gb} GB of GPU memory; "
                                      f"training nodes need >= {cat.RAM_PER_VRAM} x ({item.total_vram_gb * cat.RAM_PER_VRAM:g} GiB); "
                                      "pick a larger type or give a gpu requirement"))
        if item.gpu_vram_gb < req.min_vram_gb:
            out.append(Problem(where, f"{name} has {item.gpu_vram_gb} GB per GPU; the workload needs "
                                      f">= {req.min_vram_gb} GB (minGpuMemoryGb)"))
        if req.scratch_source == "instance-store" and item.nvme_gb < req.scratch_gb:
            out.append(Problem(where, f"{name} has {item.nvme_gb} GB of local NVMe; scratch asks for "
                                      f"{req.scratch_gb} GB from instance-store — use source: auto or data-disk"))
    return out

