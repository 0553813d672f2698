"""What the clouds refuse at `pulumi up` although the mock engine accepts it, checked while the
spec is read: CIDR sizes, reserved tag keys, bucket names, API access CIDRs, cluster address
ranges, names that would collide, and features a cloud does not build. The limits and their
sources are data (data/constraints.yaml, data/capabilities.yaml)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from ipaddress import IPv4Network

from infra import rendezvous
from infra.core import catalog as cat
from policies.gts_policy.addresses import opens_internet
from infra.buckets import bucket
from infra.clouds import profile
from infra.checks.value_checks import run_nodes
from infra.core.errors import Problem
from infra.model.spec import StackSpec
from infra.model.tags import stack_tags
from infra.resolve.groups import GROUP_LABELS, TAG_NODE_GROUP, TAG_WORKLOAD

# Pod and service ranges of the managed clusters (ACK, TKE); they must not overlap any VPC.
POD_CIDR = IPv4Network("172.20.0.0/16")
SERVICE_CIDR = IPv4Network("172.21.0.0/20")
PRIVATE_192 = IPv4Network("192.168.0.0/16")
# Ranges a caller on the internet never comes from: RFC 1918, shared (CGNAT), loopback, link-local.
NOT_INTERNET = tuple(IPv4Network(c) for c in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                                               "127.0.0.0/8", "169.254.0.0/16"))


def check(spec: StackSpec) -> list[Problem]:
    return [*_cidr_sizes(spec), *_tags(spec), *_buckets(spec), *_api_access(spec), *_cluster_ranges(spec),
            *_features(spec), *_joined_names(spec), *_subnet_zones(spec), *_ack_pool_marks(spec), *_egress(spec),
            *_images(spec), *_multi_node(spec), *_store_subnets(spec)]


def _store_subnets(spec: StackSpec) -> Iterator[Problem]:
    """Alibaba and Tencent stores sit in a vSwitch / subnet of their own, a free /28 of the VPC
    (infra/rendezvous.py own_subnet), at most OWN_SUBNET_STORES of them; AWS stores in the first
    subnet's reserved range, at most MAX_STORES."""
    for i, net in enumerate(spec.networks):
        count = rendezvous.stores_in(spec, net)
        if net.cloud not in rendezvous.OWN_SUBNET_CLOUDS and count > rendezvous.MAX_STORES:
            yield Problem(f"networks[{i}]", f"{net.name} holds {count} multi-node VM groups; its stores' reserved "
                                            f"/{rendezvous.STORE_RANGE_PREFIX} of the first subnet takes at most "
                                            f"{rendezvous.MAX_STORES}: move some to another network")
        if net.cloud not in rendezvous.OWN_SUBNET_CLOUDS or not count:
            continue
        what = profile(net.cloud).store_subnet_clear_of
        if rendezvous.own_subnet(spec, net) is None:
            yield Problem(f"networks[{i}].cidr", f"{net.name}: no /{rendezvous.OWN_SUBNET_PREFIX} of {net.cidr} is "
                                                 f"left outside its {what} for the rendezvous stores' own "
                                                 f"{profile(net.cloud).subnet_word} (their "
                                                 f"{count} multi-node VM group(s) need one); shrink a subnet or "
                                                 f"widen networks[{i}].cidr")
        if count > rendezvous.OWN_SUBNET_STORES:
            yield Problem(f"networks[{i}]", f"{net.name} holds {count} multi-node VM groups; its stores' own "
                                            f"/{rendezvous.OWN_SUBNET_PREFIX} takes at most "
                                            f"{rendezvous.OWN_SUBNET_STORES}: move some to another network")


def _multi_node(spec: StackSpec) -> Iterator[Problem]:
    """Multi-node runs are elastic torchrun jobs meeting at a rendezvous store (infra/rendezvous.py):
    accelerate and Horovod need a fixed machine rank per node, which a fleet of spot VMs or a
    Job's replaced pods do not have."""
    launcher = spec.training.launcher
    for i, g in enumerate(spec.node_groups):
        nodes = run_nodes(g)
        if g.workload == "training" and nodes > 1 and launcher != "torchrun":
            yield Problem("training.launcher", f"{g.name} trains on up to {nodes} nodes, and multi-node runs are "
                                               f"elastic torchrun jobs; {launcher} cannot join them. Use launcher: "
                                               f"torchrun, or nodeGroups[{i}].scaling.max: 1 for one node per run")


def _limits(section: str) -> dict[str, object]:
    return dict(cat.load_constraints()[section])


def _cidr_sizes(spec: StackSpec) -> Iterator[Problem]:
    for i, net in enumerate(spec.networks):
        rule = _limits("cidrPrefix").get(net.cloud)
        if not isinstance(rule, dict):
            continue
        lo, hi = rule["vpc"]
        floor = profile(net.cloud).vpc_prefix_floor_192
        if floor is not None and net.cidr.subnet_of(PRIVATE_192):
            lo = floor
        if not lo <= net.cidr.prefixlen <= hi:
            yield Problem(f"networks[{i}].cidr", f"{net.cidr} is a /{net.cidr.prefixlen}; a {cat.CLOUD_NAMES[net.cloud]} "
                                                 f"VPC must be /{lo} to /{hi} ({rule['source']})")
        slo, shi = rule["subnet"]
        for j, sub in enumerate(net.subnets):
            if not max(slo, net.cidr.prefixlen) <= sub.cidr.prefixlen <= shi:
                yield Problem(f"networks[{i}].subnets[{j}].cidr",
                              f"{sub.cidr} is a /{sub.cidr.prefixlen}; a {cat.CLOUD_NAMES[net.cloud]} subnet must be "
                              f"/{max(slo, net.cidr.prefixlen)} to /{shi} ({rule['source']})")


def _tags(spec: StackSpec) -> Iterator[Problem]:
    tags = stack_tags(spec)
    rules = _limits("tags")
    for cloud in spec.clouds:
        rule = rules[cloud]
        assert isinstance(rule, dict)
        name = cat.CLOUD_NAMES[cloud]
        for k, v in tags.items():
            where = f"tags.{k}"
            checked = [("key", k)] + ([("value", v)] if rule.get("valuesToo") else [])
            for what, text in checked:
                bad = next((p for p in rule["reservedPrefixes"] if text.lower().startswith(p)), None)
                if bad:
                    yield Problem(where, f"{what} {text!r} starts with {bad!r}, which {name} reserves; rename it "
                                         f"({rule['source']})")
                bad = next((s for s in rule.get("forbiddenSubstrings", []) if s in text), None)
                if bad:
                    yield Problem(where, f"{what} {text!r} contains {bad!r}, which {name} refuses ({rule['source']})")
            if len(k) > rule["keyMax"] or len(v) > rule["valueMax"]:
                yield Problem(where, f"{name} takes tag keys up to {rule['keyMax']} and values up to "
                                     f"{rule['valueMax']} characters; shorten it")
    if any(profile(g.cloud).instance_tags_in_metadata and g.kind == "vm" for g in spec.node_groups):
        imds = _limits("imdsTagKey")
        for k in spec.tags:
            if not re.match(str(imds["pattern"]), k) or k in imds["reserved"]:  # type: ignore[operator]
                yield Problem(f"tags.{k}", f"{k!r} cannot be an EC2 instance tag key while instance tags are in "
                                           "the metadata service (AWS GPU fleets expose them): use letters, digits and "
                                           f"+ - = . , _ : @ only, no spaces or / ({imds['source']})")


def _buckets(spec: StackSpec) -> Iterator[Problem]:
    rules = _limits("buckets")
    for cloud in spec.clouds:
        rule = rules[cloud]
        assert isinstance(rule, dict)
        name = bucket(spec, cloud).name
        problem = ""
        if not re.match(rule["pattern"], name) or len(name) > rule.get("maxLength", 63):
            problem = f"does not match {rule['pattern']}"
        for prefix in rule.get("reservedPrefixes", []):
            if name.startswith(prefix):
                problem = f"starts with {prefix!r}, which is reserved"
        for suffix in rule.get("reservedSuffixes", []):
            if name.endswith(suffix):
                problem = f"ends with {suffix!r}, which is reserved"
        if problem:
            yield Problem("storage.bucketPrefix", f"the {cat.CLOUD_NAMES[cloud]} bucket would be {name!r}, which "
                                                  f"{problem}; change the prefix ({rule['source']})")


def _api_access(spec: StackSpec) -> Iterator[Problem]:
    cidrs = spec.kubernetes.api_access_cidrs
    if not cidrs:
        return
    if opens_internet(cidrs):
        yield Problem("kubernetes.apiAccessCidrs", "together these CIDRs open the API servers to the internet; "
                                                   "list your operators' and CI runners' egress ranges")
    for k, cidr in enumerate(cidrs):
        if any(cidr.overlaps(n) for n in NOT_INTERNET):
            yield Problem(f"kubernetes.apiAccessCidrs[{k}]",
                          f"{cidr} is not a public range: the public endpoint sees the caller's public address "
                          "(the private endpoint already serves the VPCs)")
    rule = _limits("apiAccessCidrsMax")  # keyed by the clouds whose service bounds the list
    for cloud in dict.fromkeys(g.cloud for g in spec.node_groups if g.kind == "kubernetes"):
        limit = rule.get(cloud)
        if limit is not None and len(cidrs) > int(limit):  # type: ignore[call-overload]
            yield Problem("kubernetes.apiAccessCidrs", f"{len(cidrs)} CIDRs; {profile(cloud).kubernetes_service} "
                                                       f"takes at most {limit} ({rule['source']})")


def _cluster_ranges(spec: StackSpec) -> Iterator[Problem]:
    kube_clouds = {g.cloud for g in spec.node_groups  # clouds whose pods take VPC addresses have no such ranges
                   if g.kind == "kubernetes" and not profile(g.cloud).kubernetes_pods_in_vpc}
    for i, net in enumerate(spec.networks):
        if net.cloud not in kube_clouds:
            continue
        for label, cidr in (("pod", POD_CIDR), ("service", SERVICE_CIDR)):
            if net.cidr.overlaps(cidr):
                yield Problem(f"networks[{i}].cidr", f"{net.cidr} overlaps the {cat.CLOUD_NAMES[net.cloud]} clusters' "
                                                     f"{label} range {cidr}; renumber the network")


def _features(spec: StackSpec) -> Iterator[Problem]:
    nets = {n.name: n for n in spec.networks}
    for i, peer in enumerate(spec.peerings):
        net = nets.get(peer.requester)
        if net is not None and peer.via == "transit":
            reason = cat.feature_unavailable(net.cloud, "transit")
            if reason:
                yield Problem(f"peerings[{i}].via", f"'transit' on {cat.CLOUD_NAMES[net.cloud]}: {reason}")
    catalog = spec.catalog()
    for i, g in enumerate(spec.node_groups):
        named = ([("instanceType", g.instance_type)] if g.instance_type else []) + \
            [(f"fallbackTypes[{k}]", t) for k, t in enumerate(g.fallback_types)]
        models = [(where, item.gpu_model) for where, t in named if (item := catalog.get(g.cloud, t))]
        if g.gpu and g.gpu.model:
            models.append(("gpu.model", g.gpu.model))
        for where, model in models:
            reason = cat.vm_gpu_unsupported(g.cloud, model) if g.kind == "vm" else None
            if reason:
                yield Problem(f"nodeGroups[{i}].{where}", f"{model} on {cat.CLOUD_NAMES[g.cloud]} VMs: {reason}")
        if g.kind == "kubernetes" and g.schedule:
            reason = cat.feature_unavailable(g.cloud, "kubernetesSchedule")
            if reason:
                yield Problem(f"nodeGroups[{i}].schedule", f"scheduled scaling of a {cat.CLOUD_NAMES[g.cloud]} "
                                                           f"Kubernetes group: {reason}")


def _joined_names(spec: StackSpec) -> Iterator[Problem]:
    """Scheduled actions are named `<group>-<action>`: two such names in one cloud would be one
    resource name, which the engine refuses at preview."""
    seen: dict[tuple[str, str], str] = {}
    for i, g in enumerate(spec.node_groups):
        for j, action in enumerate(g.schedule):
            joined, where = f"{g.name}-{action.name}", f"nodeGroups[{i}].schedule[{j}].name"
            other = seen.get((g.cloud, joined))
            if other:
                yield Problem(where, f"makes the resource name {joined!r}, as {other} does; rename one action")
            seen[(g.cloud, joined)] = where


def _subnet_zones(spec: StackSpec) -> Iterator[Problem]:
    """Subnets are named after their zone: one subnet per zone and network."""
    for i, net in enumerate(spec.networks):
        zones: dict[str, int] = {}
        for j, sub in enumerate(net.subnets):
            if sub.zone in zones:
                yield Problem(f"networks[{i}].subnets[{j}].zone",
                              f"{sub.zone!r} already has subnets[{zones[sub.zone]}]; give each zone one subnet "
                              "(make that subnet larger instead)")
            zones.setdefault(sub.zone, j)


def _ack_pool_marks(spec: StackSpec) -> Iterator[Problem]:
    """An autoscaled ACK pool carries the stack's tags, two group tags, the group's labels and the
    GPU taint; ACK refuses to autoscale it with 12 or more of them (the clouds whose profile names
    such a rule: kubernetes_pool_marks_rule)."""
    marks = len(stack_tags(spec)) + len((TAG_NODE_GROUP, TAG_WORKLOAD)) + len(GROUP_LABELS) + 1
    for cloud in dict.fromkeys(g.cloud for g in spec.node_groups if g.kind == "kubernetes"):
        key, service = profile(cloud).kubernetes_pool_marks_rule, profile(cloud).kubernetes_service
        if key is None:
            continue
        rule = _limits(key)
        most = int(rule["max"])  # type: ignore[call-overload]
        if marks > most:
            yield Problem("tags", f"{service} GPU pools would carry {marks} tags, labels and taints together; "
                                  f"{service} autoscales a pool only with at most {most} ({rule['source']}): "
                                  f"drop {marks - most} tag(s)")


def _egress(spec: StackSpec) -> Iterator[Problem]:
    """Nodes have no public address: without NAT a node pulls no image, package or driver."""
    hosting = {g.network for g in spec.node_groups}
    for i, net in enumerate(spec.networks):
        if net.name in hosting and not net.nat:
            groups = ", ".join(g.name for g in spec.node_groups if g.network == net.name)
            yield Problem(f"networks[{i}].nat", f"the nodes of {groups} need egress to pull their images, drivers and "
                                                "packages (they have no public address); set nat: true")


DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _images(spec: StackSpec) -> Iterator[Problem]:
    """Images by digest only (a tag can be moved to other bytes), and a way to push them."""
    t = spec.training
    if not DIGEST.search(t.image):
        yield Problem("training.image", f"{t.image!r} is not pinned by digest; append @sha256:<digest> "
                                        "(`docker buildx imagetools inspect <image>` prints it)")
    for cloud, ref in t.prebuilt_images.items():
        if not DIGEST.search(ref):
            yield Problem(f"training.prebuiltImages.{cloud}", f"{ref!r} is not pinned by digest; append @sha256:<digest>")
    for i, group in enumerate(spec.node_groups):
        own = group.training.image if group.training else None
        if not own:
            continue
        if not DIGEST.search(own):
            yield Problem(f"nodeGroups[{i}].training.image", f"{own!r} is not pinned by digest; append @sha256:<digest> "
                                                             "(`docker buildx imagetools inspect <image>` prints it)")
        if group.cloud in t.prebuilt_images:
            yield Problem(f"nodeGroups[{i}].training.image",
                          f"training.prebuiltImages.{group.cloud} replaces every trainer image on {group.cloud}, so "
                          "this one would never be built; drop one of the two")
    clouds_with_nodes = {g.cloud for g in spec.node_groups}
    for i, g in enumerate(spec.node_groups):
        net = spec.network(g.network)
        home = spec.clouds[g.cloud].region
        if profile(g.cloud).registry_regional and g.cloud not in t.prebuilt_images and spec.region_of(net) != home:
            yield Problem(f"nodeGroups[{i}].network",
                          f"{g.name} runs in {spec.region_of(net)}, but the stack's {cat.CLOUD_NAMES[g.cloud]} registry "
                          f"serves VPCs in {home} only (ACR EE VPC endpoints and TCR VPC attachments are regional); "
                          f"put the group in a {home} network or set training.prebuiltImages.{g.cloud} to an image "
                          "its nodes can pull")
    for cloud in sorted(c for c in clouds_with_nodes if profile(c).registry_regional):
        if cloud not in t.prebuilt_images and not spec.kubernetes.api_access_cidrs:
            yield Problem("kubernetes.apiAccessCidrs", f"the {cat.CLOUD_NAMES[cloud]} registry takes the trainer image "
                                                       "only from these CIDRs (it is closed to the internet otherwise); "
                                                       "list where `pulumi up` runs, or set "
                                                       f"training.prebuiltImages.{cloud}")
