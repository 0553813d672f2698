"""Stock and launch failures on Tencent Cloud, asked of the cloud's own API 3.0, signed with the
node's own TC3-HMAC-SHA256 signer (infra/clouds/tencentcloud/node.py call); the interface is
infra/capacity/stock.py:

- CVM DescribeZoneInstanceConfigInfos (2017-03-12): Filters zone, instance-type,
  instance-charge-type (SPOTPAID | POSTPAID_BY_HOUR | PREPAID); each InstanceTypeQuotaSet item says
  Status (SELL | SOLD_OUT) and StatusCategory (EnoughStock | NormalStock | UnderStock |
  WithoutStock) (CVM API reference, tencentcloud.com/document/api/213/33254; 40 requests/s). One call for up to
  five types (a filter takes five values).
- AS DescribeAutoScalingActivities (2018-04-19): Filters auto-scaling-group-id, Limit; a FAILED or
  PARTIALLY_SUCCESSFUL activity whose StatusMessage says the type is sold out or the resources
  are insufficient is a capacity failure (AS API reference, cloud.tencent.com/document/api/377/31735; "Scaling
  Activity Failed", document/product/377/32527: "The CVM is sold out"), unless a later activity
  SUCCESSFUL; `since` goes as the call's StartTime (UTC, YYYY-MM-DDThh:mm:ssZ).
- AS DescribeAutoScalingGroups (2018-04-19): Filters auto-scaling-group-id; the group is short
  when its InServiceInstanceCount is under its DesiredCapacity.

- CVM DescribeAccountQuota (2017-03-12): Filters zone and quota-type (SpotPaidQuotaSet |
  PostPaidQuotaSet | PrePaidQuotaSet, the market's); AccountQuotaOverview.AccountQuota.<set>[]
  says Zone, TotalQuota, UsedQuota, RemainingQuota (CVM API reference, DescribeAccountQuota; the
  filter names as the Terraform provider sends them, data_source_tc_cvm_account_quota.go). Asked
  once, for the zone of the type found in stock (a sold-out place costs no quota call). The
  reference does not say the quota's unit (instances or vCPUs): a zone whose RemainingQuota is under
  the number of nodes is refused, which is short under either unit; a quota enough in instances
  but not in vCPUs is left for the launch to tell. Prepaid: also OnceQuota (what one purchase may
  buy). A quota call that fails (a CAM policy without cvm:DescribeAccountQuota, throttling) is a
  quota unknown: the stock stands.

The tests answer
with recorded responses written from the documented response shapes
(tests/data/capacity/tencentcloud/), not captured from a live account.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import urllib.request
from collections.abc import Callable
from typing import Any

from infra.capacity.stock import Ask, Failure, Verdict, newer, stamp
from infra.model.spec_capacity import Market
from training import cloudmeta

Send = Callable[[urllib.request.Request, float], dict[str, Any]]  # (request, timeout in seconds)
TIMEOUT_S = 4.0  # one call's socket timeout, inside the broker's budget per place (infra/capacity/stock.py)
IN_STOCK = ("EnoughStock", "NormalStock", "UnderStock")
CAPACITY_MARKERS = ("ResourceInsufficient", "SoldOut", "SOLD_OUT", "sold out", "InsufficientInventory",
                    "NoAvailableZone")


def charge_type(market: Market) -> str:
    """The instance-charge-type DescribeZoneInstanceConfigInfos filters on, by the market's own
    answers: SPOTPAID, POSTPAID_BY_HOUR, else PREPAID."""
    if market.spot:
        return "SPOTPAID"
    if market.on_demand:
        return "POSTPAID_BY_HOUR"
    return "PREPAID"


def quota_set(market: Market) -> str:
    """The DescribeAccountQuota set of the market: SpotPaidQuotaSet, PostPaidQuotaSet, else PrePaidQuotaSet."""
    if market.spot:
        return "SpotPaidQuotaSet"
    if market.on_demand:
        return "PostPaidQuotaSet"
    return "PrePaidQuotaSet"


def _send(request: urllib.request.Request, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return dict(json.loads(resp.read().decode()))


class TencentcloudStock:
    def __init__(self, region: str, creds: cloudmeta.Credentials, send: Send = _send):
        self.region, self.creds, self.send = region, creds, send
        self.node: Any = cloudmeta.cloud_node("tencentcloud")

    def _call(self, service: str, version: str, action: str, params: dict[str, Any], ask: Ask | None = None
              ) -> dict[str, Any]:
        timeout = ask.timeout(TIMEOUT_S) if ask is not None else TIMEOUT_S
        request = self.node.call(self.creds, self.region, action, params, f"https://{service}.tencentcloudapi.com/",
                                 dt.datetime.now(dt.timezone.utc), service=service, version=version)
        found = self.send(request, timeout).get("Response", {})
        if "Error" in found:
            raise RuntimeError(f"{action} answered {found['Error']}")
        return dict(found)

    def ask(self, ask: Ask) -> Verdict:
        calls, items = 0, []
        for start in range(0, len(ask.types), 5):
            filters = [{"Name": "instance-type", "Values": list(ask.types[start:start + 5])},
                       {"Name": "instance-charge-type", "Values": [charge_type(ask.market)]}]
            if ask.zone:
                filters.append({"Name": "zone", "Values": [ask.zone]})
            answer = self._call("cvm", "2017-03-12", "DescribeZoneInstanceConfigInfos", {"Filters": filters}, ask)
            calls += 1
            items += answer.get("InstanceTypeQuotaSet", [])
        where = ask.zone or ask.region
        for itype in ask.types:
            mine = [i for i in items if i.get("InstanceType") == itype]
            good = next((i for i in mine if i.get("Status") == "SELL" and i.get("StatusCategory") in IN_STOCK), None)
            if good is not None:
                return self._within_quota(ask, str(good.get("Zone") or where), f"{itype} {good['StatusCategory']} in "
                                          f"{good.get('Zone', where)} (DescribeZoneInstanceConfigInfos)", calls)
        said = ", ".join(f"{i.get('InstanceType')} {i.get('Status')}/{i.get('StatusCategory')}" for i in items)
        return Verdict(False, f"{said or '/'.join(ask.types) + ' not offered'} in {where} "
                              "(DescribeZoneInstanceConfigInfos)", calls)

    def _within_quota(self, ask: Ask, zone: str, stock: str, calls: int) -> Verdict:
        """The stock verdict, unless the zone's quota left for the market (or what one prepaid
        purchase may buy) is under the nodes."""
        kind = quota_set(ask.market)
        try:
            answer = self._call("cvm", "2017-03-12", "DescribeAccountQuota", {"Filters": [
                {"Name": "zone", "Values": [zone]}, {"Name": "quota-type", "Values": [kind]}]}, ask)
        except Exception as exc:  # noqa: BLE001 (no quota answer: the stock stands, the launch would tell)
            return Verdict(True, f"{stock}, quota unknown ({type(exc).__name__}: {str(exc)[:120]})", calls + 1)
        sets = answer.get("AccountQuotaOverview", {}).get("AccountQuota", {}).get(kind) or []
        mine = [q for q in sets if q.get("Zone") in (zone, None)]
        for field in ("RemainingQuota", "OnceQuota"):
            known = [n for n in (q.get(field) for q in mine) if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
            if known and min(known) < ask.nodes:
                return Verdict(False, f"{kind} {field} {min(known)} in {zone} is under the {ask.nodes} nodes "
                                      "(DescribeAccountQuota)", calls + 1)
        left = [n for n in (q.get("RemainingQuota") for q in mine) if isinstance(n, int) and not isinstance(n, bool)]
        said = f"quota left {min(left)}" if left else "quota unknown"
        return Verdict(True, f"{stock}, {said} (DescribeAccountQuota)", calls + 1)

    def failures(self, group_id: str, since: str | None = None) -> list[Failure]:
        params: dict[str, Any] = {"Filters": [{"Name": "auto-scaling-group-id", "Values": [group_id]}], "Limit": 20}
        if since:
            params["StartTime"] = stamp(since).astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        answer = self._call("as", "2018-04-19", "DescribeAutoScalingActivities", params)
        failed, launched = [], ""
        for act in answer.get("ActivitySet", []):
            message, at = str(act.get("StatusMessage", "")), str(act.get("StartTime", ""))
            if act.get("StatusCode") == "SUCCESSFUL" and at:
                launched = max(launched, at, key=lambda t: stamp(t).timestamp() if t else 0.0)
            elif act.get("StatusCode") in ("FAILED", "PARTIALLY_SUCCESSFUL") and any(m in message for m in CAPACITY_MARKERS):
                failed.append(Failure(at, message))
        return newer(failed, launched, since)

    def nodes(self, group_id: str) -> tuple[int, int]:
        answer = self._call("as", "2018-04-19", "DescribeAutoScalingGroups",
                            {"Filters": [{"Name": "auto-scaling-group-id", "Values": [group_id]}]})
        groups = answer.get("AutoScalingGroupSet", [])
        if not groups:
            return 0, 0
        return int(groups[0].get("InServiceInstanceCount", 0)), int(groups[0].get("DesiredCapacity", 0))

def open_api(region: str, creds: cloudmeta.Credentials | None = None, send: Send = _send) -> TencentcloudStock:
    """The region's API with the operator's keys, the ones the Pulumi provider uses (TENCENTCLOUD_SECRET_ID,
    TENCENTCLOUD_SECRET_KEY, and
    TENCENTCLOUD_SECURITY_TOKEN for STS keys), or the ones given."""
    creds = creds or cloudmeta.Credentials(os.environ.get("TENCENTCLOUD_SECRET_ID", ""),
                                           os.environ.get("TENCENTCLOUD_SECRET_KEY", ""),
                                           os.environ.get("TENCENTCLOUD_SECURITY_TOKEN", ""), 0.0)
    return TencentcloudStock(region, creds, send)
