"""The pack's security, protection and tagging rules: stateful resources protected, no public
ingress, hardened instance metadata, no instance passwords, private encrypted versioned buckets,
encrypted disks, the provider SDKs' known gaps, private Kubernetes API endpoints, required tags
and routable API access sources. Each registers itself where it is written (`@stack_rule` /
`@resource_rule`, registry.py), in the pack's order. Per-cloud facts come from the pack's one
table, clouds.py."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from . import catalog as cat
from . import clouds
from .addresses import opens_internet
from .registry import resource_rule, stack_rule
from .resources import Res, tags_of, taggable


@functools.lru_cache(maxsize=1)
def _stateful() -> Mapping[str, str]:
    """type -> why it is protected (policies/data/stateful.yaml, a copy of infra/data/'s); read
    once per process, not once per resource (the rule runs on every resource of the plan)."""
    import yaml

    data = yaml.safe_load((cat.DATA_DIR / "stateful.yaml").read_text(encoding="utf-8"))
    return {t: str(v["why"]) for t, v in data["types"].items()}


@resource_rule("stateful-protected", "Buckets, keys, clusters and registries are protected from destroy and "
               "replacement (prod).", "disabled")
def stateful_protected(r: Res, config: Mapping[str, Any]) -> list[str]:
    stateful = _stateful()
    if r.type not in stateful or r.protect:
        return []
    return [f"{r.type} is not protected, and it holds {stateful[r.type]}: a destroy or a replacement would take "
            "it. Register it with protect=True (infra/render/protection.py does for every type in "
            "infra/data/stateful.yaml), or set protectStateful: true"]



def sdk_gap(type_token: str, feature: str) -> str | None:
    """Why an SDK cannot set `feature` on `type_token` (infra/data/capabilities.yaml), or None."""
    gaps = cat.pack_capabilities().get("sdkGaps", {}).get(type_token, {})
    return str(gaps[feature]) if feature in gaps else None



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


@stack_rule("no-public-ingress", "No ingress from 0.0.0.0/0, for SSH, RDP or anything else.", "mandatory")
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


@resource_rule("no-public-ingress-rule", "No security group or ingress rule resource admits the internet (IPv4 or "
               "IPv6, split ranges included), judged on each before it is created.", "mandatory")
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


def harden_metadata(r: Res) -> dict[str, Any] | None:
    """The remediation: tokens required (nothing on the node reads metadata without one)."""
    props = dict(r.props)
    if r.type in AWS_METADATA:
        props["metadataOptions"] = {**dict(r.get("metadataOptions") or {}), "httpTokens": "required"}
        return props
    if r.type in ALI_METADATA:
        return {**props, "httpTokens": "required"}
    return None


@resource_rule("metadata-hardened", "Instance metadata requires tokens (IMDSv2 / hardened mode).", "mandatory",
               remediate=harden_metadata)
def metadata_hardened(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    if r.type in AWS_METADATA and r.get("metadataOptions", "httpTokens") != "required":
        return ["instance metadata must require IMDSv2 tokens: metadataOptions.httpTokens = required"]
    if r.type in ALI_METADATA and r.get("httpTokens") != "required":
        return ["ECS metadata must be in hardened (token) mode: http_tokens = required"]
    return []


PASSWORD_KEYS = ("password", "kmsEncryptedPassword")


@resource_rule("no-instance-passwords", "No instance passwords.", "mandatory")
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


@stack_rule("buckets-private-encrypted-versioned", "Buckets are private, encrypted and versioned.", "mandatory")
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

@resource_rule("disks-encrypted", "Every disk and shared file system is encrypted.", "mandatory",
               remediate=encrypt_disks)
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



@resource_rule("known-sdk-gaps", "Security settings the provider SDKs cannot express yet (with the workaround).",
               "advisory")
def known_sdk_gaps(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    """Security settings the pinned SDKs cannot express, on the resources that need them."""
    reason = sdk_gap(r.type, "dataDiskEncryption")
    found = [f"data disks are not encrypted: {reason}"] if reason and r.get("dataDisks") else []
    at_rest = sdk_gap(r.type, "atRestEncryption")
    return found + ([f"the shared file system is not encrypted at rest: {at_rest}"] if at_rest else [])


@resource_rule("kubernetes-api-private", "Kubernetes API endpoints are not public (prod).", "disabled")
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


REQUIRED_TAGS = ("owner", "cost-center", "env")


@resource_rule("required-tags", "owner, cost-center and env on every taggable resource.", "mandatory",
               {"tags": {"type": "array", "items": {"type": "string"}}})
def required_tags(r: Res, cfg: Mapping[str, Any]) -> list[str]:
    need = list(cfg.get("tags") or REQUIRED_TAGS)
    if not taggable(r.type):
        return []
    missing = [t for t in need if not tags_of(r).get(t)]
    return [f"{r.type} lacks tag(s) {', '.join(missing)}; the stack's tags must reach it"] if missing else []


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


@resource_rule("kubernetes-api-sources-routable", "Kubernetes API and registry push endpoints admit real public "
               "sources, not documentation or private-use ranges (kubernetes.apiAccessCidrs).", "mandatory")
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
