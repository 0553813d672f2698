"""Stock and launch failures on Alibaba Cloud, asked of the cloud's own RPC API, signed with the
node's own signer (infra/clouds/alicloud/node.py rpc_request, signature v1); the interface is
infra/capacity/stock.py:

- ECS DescribeAvailableResource (2014-05-26): RegionId, DestinationResource=InstanceType, ZoneId,
  InstanceChargeType=PostPaid | PrePaid, SpotStrategy=SpotAsPriceGo | NoSpot,
  IoOptimized=optimized; each zone's AvailableResources.AvailableResource[].SupportedResources
  .SupportedResource[] says Status (Available | SoldOut) and StatusCategory (WithStock |
  ClosedWithStock | WithoutStock | ClosedWithoutStock) per type (ECS API reference,
  help.aliyun.com/document_detail/66186). One call for all the group's types (InstanceType is
  optional: left out, the answer lists every type, read here for the group's), the first in stock
  in the group's order taken.
- ESS DescribeScalingActivities (2014-08-28): RegionId, ScalingGroupId, PageSize; a Failed or
  Warning activity whose StatusMessage names NoStock is a capacity failure (Auto Scaling API
  reference, DescribeScalingActivities), unless a later activity succeeded (Successful: the
  group launched after it). The call has no time filter: `since` is applied to the answer.
- ESS DescribeScalingGroups (2014-08-28): RegionId, ScalingGroupIds.1; the group is short when
  its ActiveCapacity (instances In Service) is under its DesiredCapacity (MinSize when the group
  has no desired capacity).

- ECS DescribeAccountAttributes (2014-05-26): RegionId, ZoneId, AttributeName.N; the account's
  vCPU quota for the market — max-spot-instance-vcpu-count and used-spot-instance-vcpu-count (spot),
  max-postpaid-instance-vcpu-count and used-postpaid-instance-vcpu-count (pay-as-you-go); each
  AccountAttributeItem's AttributeValues.ValueItem[].Value (ECS API reference,
  DescribeAccountAttributes). Asked once, after a type in stock is found (a sold-out place costs
  no quota call); a place whose vCPUs left are under the nodes' (nodes x that type's vCPUs) is
  refused. An elasticity assurance's instances are pay-as-you-go: the postpaid quota. Prepaid
  (subscription) nodes: not asked. A value is read from the ValueItem of the asked zone (or one
  without a zone); several that could apply, or none, is a quota unknown, as is a quota call that
  fails (a RAM policy without ecs:DescribeAccountAttributes, throttling): the stock stands.

The tests answer with recorded responses written from the documented response
shapes (tests/data/capacity/alicloud/), not captured from a live account.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import urllib.request
from collections.abc import Callable
from typing import Any

from infra.capacity.stock import Ask, Failure, Verdict, newer, stamp
from infra.model.spec_capacity import Market
from training import cloudmeta

Send = Callable[[urllib.request.Request, float], dict[str, Any]]  # (request, timeout in seconds)
TIMEOUT_S = 4.0  # one call's socket timeout, inside the broker's budget per place (infra/capacity/stock.py)
IN_STOCK = ("WithStock", "ClosedWithStock")
# The market's (quota, used) account attributes, in vCPUs.
SPOT_QUOTA = ("max-spot-instance-vcpu-count", "used-spot-instance-vcpu-count")
POSTPAID_QUOTA = ("max-postpaid-instance-vcpu-count", "used-postpaid-instance-vcpu-count")
CAPACITY_MARKERS = ("NoStock", "Zone.NotOnSale", "InvalidInstanceType.NotSupported", "QuotaExceed")


def _charge(market: Market) -> tuple[str, str]:
    """(InstanceChargeType, SpotStrategy) DescribeAvailableResource is asked with, by the market's
    own answers: spot and on-demand are PostPaid, the rest (prepaid, an assurance) PrePaid."""
    if market.spot:
        return "PostPaid", "SpotAsPriceGo"
    if market.on_demand:
        return "PostPaid", "NoSpot"
    return "PrePaid", "NoSpot"


def _send(request: urllib.request.Request, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return dict(json.loads(resp.read().decode()))


class AlicloudStock:
    def __init__(self, region: str, creds: cloudmeta.Credentials, send: Send = _send):
        self.region, self.creds, self.send = region, creds, send
        self.node: Any = cloudmeta.cloud_node("alicloud")

    def _call(self, service: str, params: dict[str, str], ask: Ask | None = None) -> dict[str, Any]:
        url = f"https://{service}.{self.region}.aliyuncs.com/"
        timeout = ask.timeout(TIMEOUT_S) if ask is not None else TIMEOUT_S
        return self.send(self.node.rpc_request(self.creds, url, dt.datetime.now(dt.timezone.utc),
                                               {**params, "RegionId": self.region}), timeout)

    def ask(self, ask: Ask) -> Verdict:
        charge = _charge(ask.market)
        params = {"Action": "DescribeAvailableResource", "Version": "2014-05-26", "DestinationResource": "InstanceType",
                  "InstanceChargeType": charge[0], "IoOptimized": "optimized"}
        if charge[0] == "PostPaid":
            params["SpotStrategy"] = charge[1]
        if ask.zone:
            params["ZoneId"] = ask.zone
        answer, seen = self._call("ecs", params, ask), []
        for itype in ask.types:
            status = _status(answer, itype, ask.zone)
            if status in IN_STOCK:
                return self._within_quota(ask, itype, f"{itype} {status} in {ask.zone or ask.region} "
                                                      "(DescribeAvailableResource)")
            seen.append(f"{itype} {status or 'not offered'}")
        return Verdict(False, f"{', '.join(seen)} in {ask.zone or ask.region} (DescribeAvailableResource)", 1)

    def _within_quota(self, ask: Ask, itype: str, stock: str) -> Verdict:
        """The stock verdict, unless the account's vCPUs left for the market are under the nodes'."""
        market = ask.market
        names = SPOT_QUOTA if market.spot else POSTPAID_QUOTA if market.on_demand or market.reservation else None
        if names is None:
            return Verdict(True, f"{stock}, quota not asked (prepaid)", 1)
        params = {"Action": "DescribeAccountAttributes", "Version": "2014-05-26",
                  "AttributeName.1": names[0], "AttributeName.2": names[1]}
        if ask.zone:
            params["ZoneId"] = ask.zone
        try:
            values = _attributes(self._call("ecs", params, ask), ask.zone)
        except Exception as exc:  # noqa: BLE001 (no quota answer: the stock stands, the launch would tell)
            return Verdict(True, f"{stock}, vCPU quota unknown ({type(exc).__name__}: {str(exc)[:120]})", 2)
        most, used, need = values.get(names[0]), values.get(names[1], 0), ask.nodes * ask.vcpus_of(itype)
        if most is not None and most - used < need:
            return Verdict(False, f"vCPU quota left {most - used:g} ({names[0]} {most:g}, used {used:g}) is under "
                                  f"the {need} the nodes need (DescribeAccountAttributes)", 2)
        left = "unknown" if most is None else f"{most - used:g}"
        return Verdict(True, f"{stock}, vCPU quota left {left} (DescribeAccountAttributes)", 2)

    def failures(self, group_id: str, since: str | None = None) -> list[Failure]:
        answer = self._call("ess", {"Action": "DescribeScalingActivities", "Version": "2014-08-28",
                                    "ScalingGroupId": group_id, "PageSize": "50"})
        failed, launched = [], ""
        for act in answer.get("ScalingActivities", {}).get("ScalingActivity", []):
            message, at = str(act.get("StatusMessage", "")), str(act.get("StartTime", ""))
            if act.get("StatusCode") == "Successful" and at:
                launched = max(launched, at, key=lambda t: stamp(t).timestamp() if t else 0.0)
            elif act.get("StatusCode") in ("Failed", "Warning") and any(m in message for m in CAPACITY_MARKERS):
                failed.append(Failure(at, message))
        return newer(failed, launched, since)

    def nodes(self, group_id: str) -> tuple[int, int]:
        answer = self._call("ess", {"Action": "DescribeScalingGroups", "Version": "2014-08-28",
                                    "ScalingGroupIds.1": group_id})
        groups = answer.get("ScalingGroups", {}).get("ScalingGroup", [])
        if not groups:
            return 0, 0
        want = groups[0].get("DesiredCapacity", groups[0].get("MinSize", 0))
        return int(groups[0].get("ActiveCapacity", 0)), int(want or 0)

def _attributes(answer: dict[str, Any], zone: str | None) -> dict[str, float]:
    """Each attribute's value for the zone: from its one ValueItem of that zone or of none (a
    region-wide value); none, or several that could apply, leave it out (unknown)."""
    found: dict[str, float] = {}
    for item in answer.get("AccountAttributeItems", {}).get("AccountAttributeItem", []):
        values = []
        for value in item.get("AttributeValues", {}).get("ValueItem", []):
            if value.get("ZoneId") not in (None, "", zone):
                continue
            try:
                number = float(value.get("Value"))
            except (TypeError, ValueError):
                continue
            if math.isfinite(number) and number >= 0:
                values.append(number)
        if len(values) == 1:
            found[str(item.get("AttributeName"))] = values[0]
    return found


def _status(answer: dict[str, Any], itype: str, zone: str | None) -> str:
    """The best StatusCategory of `itype` in the answer's zones ('' when no zone sells it)."""
    found = []
    for z in answer.get("AvailableZones", {}).get("AvailableZone", []):
        if zone and z.get("ZoneId") != zone:
            continue
        for res in z.get("AvailableResources", {}).get("AvailableResource", []):
            for sup in res.get("SupportedResources", {}).get("SupportedResource", []):
                if sup.get("Value") == itype:
                    found.append(str(sup.get("StatusCategory", "")))
    return next((s for s in found if s in IN_STOCK), found[0] if found else "")


def open_api(region: str, creds: cloudmeta.Credentials | None = None, send: Send = _send) -> AlicloudStock:
    """The region's API with the operator's keys, the ones the Pulumi provider uses (ALICLOUD_ACCESS_KEY,
    ALICLOUD_SECRET_KEY, and ALICLOUD_SECURITY_TOKEN for STS keys), or the ones given."""
    creds = creds or cloudmeta.Credentials(os.environ.get("ALICLOUD_ACCESS_KEY", ""),
                                           os.environ.get("ALICLOUD_SECRET_KEY", ""),
                                           os.environ.get("ALICLOUD_SECURITY_TOKEN", ""), 0.0)
    return AlicloudStock(region, creds, send)
