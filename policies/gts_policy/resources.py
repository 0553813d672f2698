"""A cloud-neutral view of the resources the rules inspect.

Every rule reads resources through these helpers, so that one rule covers the equivalent
resource types of AWS, Alibaba Cloud and Tencent Cloud. Properties are the engine's
camelCase inputs, as both the policy engine and the offline plan see them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from .clouds import SDK_PACKAGES

# The stack marks GPU capacity with these instance tags (`:`) and Kubernetes node labels (`/`).
WORKLOAD_KEYS = ("gpu-training-stack:workload", "gpu-training-stack/workload")
GROUP_KEYS = ("gpu-training-stack:node-group", "gpu-training-stack/node-group")


def _first(values: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    return next((str(values[k]) for k in keys if values.get(k)), None)


def _is_list(value: Any) -> bool:
    """Lists as the plan sees them and as the policy SDK's unknown-checking proxy wraps them."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


@dataclass(frozen=True)
class Res:
    type: str
    name: str
    props: Mapping[str, Any]
    protect: bool = False  # the resource option (Pulumi hands it to policies as opts.protect)

    @property
    def cloud(self) -> str:
        return self.type.split(":", 1)[0]

    def get(self, *path: str | int, default: Any = None) -> Any:
        value: Any = self.props
        for part in path:
            if isinstance(part, int):
                if not _is_list(value) or len(value) <= part:
                    return default
                value = value[part]
            else:
                if not isinstance(value, Mapping) or part not in value:
                    return default
                value = value[part]
        return value


class Evaluation(list[Res]):
    """The resources of one offline evaluation of every rule (rules.evaluate): work that several
    rules derive from all of them alike (rules_cost._capacities) is kept in `derived` and done
    once, not once per rule (issue 44: ten rules walked every resource for the GPU capacities).
    Read-only to the rules. The policy engine hands each stack policy a plain list of its own,
    where that work is done per rule as before."""

    def __init__(self, items: Iterable[Res] = ()) -> None:
        super().__init__(items)
        self.derived: dict[str, Any] = {}


@dataclass(frozen=True)
class Capacity:
    """GPU capacity a resource buys: instance types, most nodes, how they are bought."""

    instance_types: list[str]
    max_nodes: int
    min_nodes: int
    spot: bool  # all of it (beyond a zero on-demand base)
    on_demand_nodes: int  # nodes always bought on-demand
    workload: str  # training | inference | unknown
    disk_gb: int  # largest data / root disk per node
    group: str


def _tags(res: Res) -> dict[str, str]:
    tags = res.props.get("tags")
    if isinstance(tags, Sequence) and not isinstance(tags, str):  # aws:autoscaling/group:Group
        return {str(t.get("key")): str(t.get("value")) for t in tags if isinstance(t, Mapping)}
    if isinstance(tags, Mapping):
        return {str(k): str(v) for k, v in tags.items()}
    labels = res.get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}


def tags_of(res: Res) -> dict[str, str]:
    return _tags(res)


def _workload(res: Res) -> str:
    tags = _tags(res)
    labels = res.get("labels") or {}
    return _first(tags, WORKLOAD_KEYS) or (_first(labels, WORKLOAD_KEYS) if isinstance(labels, Mapping) else None) \
        or "unknown"


def _max_disk(disks: Any, size_key: str) -> int:
    sizes = [int(d.get(size_key) or 0) for d in disks or [] if isinstance(d, Mapping)]
    return max(sizes, default=0)


def _aws_asg(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    policy = res.get("mixedInstancesPolicy") or {}
    dist = policy.get("instancesDistribution") or {}
    types = [o.get("instanceType") for o in (policy.get("launchTemplate") or {}).get("overrides") or []]
    base = int(dist.get("onDemandBaseCapacity") or 0)
    above = int(dist.get("onDemandPercentageAboveBaseCapacity", 100))
    lt_id = ((policy.get("launchTemplate") or {}).get("launchTemplateSpecification") or {}).get("launchTemplateId")
    lt = by_id.get(str(lt_id))
    disk = _max_disk([m.get("ebs") or {} for m in (lt.get("blockDeviceMappings") or [])], "volumeSize") if lt else 0
    return Capacity([str(x) for x in types if x], int(p.get("maxSize") or 0), int(p.get("minSize") or 0),
                    spot=base == 0 and above == 0, on_demand_nodes=base if above == 0 else int(p.get("maxSize") or 0),
                    workload=_workload(res), disk_gb=disk, group=group)


def _eks_node_group(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    scaling = p.get("scalingConfig") or {}
    lt = by_id.get(str(res.get("launchTemplate", "id")))
    disk = _max_disk([m.get("ebs") or {} for m in (lt.get("blockDeviceMappings") or [])], "volumeSize") if lt else int(p.get("diskSize") or 0)
    spot = p.get("capacityType") == "SPOT"
    return Capacity(list(p.get("instanceTypes") or []), int(scaling.get("maxSize") or 0), int(scaling.get("minSize") or 0),
                    spot=spot, on_demand_nodes=0 if spot else int(scaling.get("maxSize") or 0),
                    workload=_workload(res), disk_gb=disk, group=group)


def _aws_instance(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    spot = bool(p.get("instanceMarketOptions"))
    return Capacity([str(p.get("instanceType"))], 1, 1, spot, 0 if spot else 1, _workload(res),
                    _max_disk(p.get("ebsBlockDevices"), "volumeSize"), group)


def _ecs_instance(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    spot = p.get("spotStrategy") in ("SpotAsPriceGo", "SpotWithPriceLimit")
    return Capacity([str(p.get("instanceType"))], 1, 1, spot, 0 if spot else 1, _workload(res),
                    _max_disk(p.get("dataDisks"), "size"), group)


def _ess_configuration(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    grp = by_id.get(str(p.get("scalingGroupId")))
    types = list(p.get("instanceTypes") or ([p["instanceType"]] if p.get("instanceType") else []))
    spot = p.get("spotStrategy") in ("SpotAsPriceGo", "SpotWithPriceLimit")
    base = int(grp.get("onDemandBaseCapacity") or 0) if grp else 0
    above = int(grp.get("onDemandPercentageAboveBaseCapacity", default=0 if spot else 100)) if grp else (0 if spot else 100)
    mx = int(grp.get("maxSize") or 0) if grp else 0
    return Capacity(types, mx, int(grp.get("minSize") or 0) if grp else 0, spot and base == 0 and above == 0,
                    base if spot else mx, _workload(grp or res), _max_disk(p.get("dataDisks"), "size"),
                    (_first(_tags(grp), GROUP_KEYS) or group) if grp else group)


def _ess_group(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    if not p.get("launchTemplateId"):
        return None
    lt = by_id.get(str(p.get("launchTemplateId")))
    types = [str(o.get("instanceType")) for o in p.get("launchTemplateOverrides") or [] if o.get("instanceType")]
    spot = lt is not None and lt.get("spotStrategy") in ("SpotAsPriceGo", "SpotWithPriceLimit")
    base = int(p.get("onDemandBaseCapacity") or 0)
    above = int(p.get("onDemandPercentageAboveBaseCapacity", 0 if spot else 100))
    mx = int(p.get("maxSize") or 0)
    return Capacity(types, mx, int(p.get("minSize") or 0), spot and base == 0 and above == 0,
                    base if spot and above == 0 else mx, _workload(res),
                    _max_disk(lt.get("dataDisks") if lt else None, "size"), group)


def _ack_pool(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    scaling = p.get("scalingConfig") or {}
    spot = p.get("spotStrategy") in ("SpotAsPriceGo", "SpotWithPriceLimit")
    mx = int(scaling.get("maxSize") or p.get("desiredSize") or 0)
    base = int(p.get("onDemandBaseCapacity") or 0)
    return Capacity(list(p.get("instanceTypes") or []), mx, int(scaling.get("minSize") or 0), spot and base == 0,
                    base if spot else mx, _workload(res), _max_disk(p.get("dataDisks"), "size"), group)


def _cvm_instance(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    spot = p.get("instanceChargeType") == "SPOTPAID"
    return Capacity([str(p.get("instanceType"))], 1, 1, spot, 0 if spot else 1, _workload(res),
                    _max_disk(p.get("dataDisks"), "dataDiskSize"), group)


def _as_config(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    grp = next((g for g in by_id.values() if g.type == "tencentcloud:As/scalingGroup:ScalingGroup"
                and g.get("configurationId") in (f"{res.name}-id", p.get("id"))), None)
    spot = p.get("instanceChargeType") == "SPOTPAID"
    mx = int(grp.get("maxSize") or 0) if grp else 0
    return Capacity(list(p.get("instanceTypes") or []), mx, int(grp.get("minSize") or 0) if grp else 0, spot,
                    0 if spot else mx, _workload(grp or res), _max_disk(p.get("dataDisks"), "diskSize"),
                    (_first(_tags(grp), GROUP_KEYS) or group) if grp else group)


def _tke_pool(res: Res, p: Mapping[str, Any], by_id: Mapping[str, Res], group: str) -> Capacity | None:
    asc = p.get("autoScalingConfig") or {}
    spot = asc.get("instanceChargeType") == "SPOTPAID"
    types = [asc["instanceType"]] if asc.get("instanceType") else []
    types += list(asc.get("backupInstanceTypes") or [])
    mx = int(p.get("maxSize") or 0)
    return Capacity(types, mx, int(p.get("minSize") or 0), spot, 0 if spot else mx,
                    _workload(res), _max_disk(asc.get("dataDisks"), "diskSize"), group)


CapacityReader = Callable[[Res, Mapping[str, Any], Mapping[str, Res], str], Capacity | None]
_CAPACITY: dict[str, CapacityReader] = {
    "aws:autoscaling/group:Group": _aws_asg,
    "aws:eks/nodeGroup:NodeGroup": _eks_node_group,
    "aws:ec2/instance:Instance": _aws_instance,
    "alicloud:ecs/instance:Instance": _ecs_instance,
    "alicloud:ess/scalingConfiguration:ScalingConfiguration": _ess_configuration,
    "alicloud:ess/scalingGroup:ScalingGroup": _ess_group,
    "alicloud:cs/nodePool:NodePool": _ack_pool,
    "tencentcloud:Instance/instance:Instance": _cvm_instance,
    "tencentcloud:As/scalingConfig:ScalingConfig": _as_config,
    "tencentcloud:Kubernetes/nodePool:NodePool": _tke_pool,
}


def capacity(res: Res, by_id: Mapping[str, Res]) -> Capacity | None:
    """The GPU capacity of a fleet / pool / instance resource; None for other resources.

    `by_id` maps ids (as the program passed them) to resources, to follow a scaling
    configuration to its group or an ASG to its launch template.
    """
    reader = _CAPACITY.get(res.type)
    if reader is None:
        return None
    return reader(res, res.props, by_id, _first(_tags(res), GROUP_KEYS) or res.name)


def index_by_id(resources: list[Res]) -> dict[str, Res]:
    """Ids as the program sees them before creation (mock ids) and after (props.id)."""
    out: dict[str, Res] = {}
    for r in resources:
        out[f"{r.name}-id"] = r
        if isinstance(r.props.get("id"), str):
            out[r.props["id"]] = r
    return out


class PackSetupError(RuntimeError):
    """The pack's environment lacks something it needs (its requirements.txt)."""


@cache
def taggable(type_token: str) -> bool:
    """Whether the provider SDK's resource class takes `tags` (AWS, Alibaba, Tencent alike)."""
    package = SDK_PACKAGES
    parts = type_token.split(":")
    if len(parts) != 3 or parts[0] not in package:
        return False
    module = parts[1].split("/")[0]
    module = {"As": "as_", "index": ""}.get(module, module.lower())
    try:
        importlib.import_module(package[parts[0]])
    except ImportError:
        # Never a silent pass: without the SDK every resource of that cloud would look untaggable.
        raise PackSetupError(f"the policy pack needs {package[parts[0]]} to know which {parts[0]} resources take "
                             "tags: install the pack's requirements.txt") from None
    try:
        mod = importlib.import_module(f"{package[parts[0]]}.{module}" if module else package[parts[0]])
        cls = getattr(mod, parts[2])
        return "tags" in inspect.signature(cls._internal_init).parameters
    except (ImportError, AttributeError):
        return False  # a type the SDK does not have: nothing to tag
