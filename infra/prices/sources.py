"""The clouds' own price sources, read in their documented formats.

- AWS: the Price List bulk offer file for EC2, per region (public, no credentials):
  https://pricing.us-east-1.amazonaws.com/offers/v1.0/aws/AmazonEC2/current/region_index.json names
  each region's current version; its index.csv is 5 metadata rows, then a header row, then one
  row per SKU and term. The plain Linux on-demand price of a type is the row with Product Family
  "Compute Instance", Region Code the region, Operating System Linux, Tenancy Shared, Pre
  Installed S/W NA, CapacityStatus Used, License Model "No License required", MarketOption
  OnDemand, TermType OnDemand and Unit Hrs (a Capacity Block SKU of p5 lists at 0.00 and differs
  only in MarketOption). Columns are read by name: the set changes over time. The reserved
  discount is the same product's Reserved term of 1 year, No Upfront, standard, per hour.
  Spot: the Spot Instance Advisor feed https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json
  (spot_advisor[region].Linux[type] = {s: savings % off on-demand, r: index into ranges}).
- Alibaba Cloud: ECS DescribePrice (2014-05-26; ResourceType instance, PriceUnit Hour, Linux):
  PriceInfo.Price.DetailInfos.DetailInfo[Resource=instanceType].TradePrice (older SDKs call the
  list ResourcePriceModel), in PriceInfo.Price.Currency (the account's site decides it). Spot:
  DescribeSpotPriceHistory (SpotPrices.SpotPriceType[] {InstanceType, SpotPrice, OriginPrice}).
- Tencent Cloud: CVM InquiryPriceRunInstances (2017-03-12; POSTPAID_BY_HOUR):
  Response.Price.InstancePrice.UnitPriceDiscount per ChargeUnit HOUR (the account's price; its
  Discount field is 0.0 in the official examples and is not used). Currency: the account's site.

`Recorded` reads the same documents from a folder (tests/data/prices/); `Live` fetches them
with urllib and the clouds' SDKs, with the user's credentials where an API needs them.
"""

from __future__ import annotations

import csv
import datetime
import functools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

PRICE_LIST = "https://pricing.us-east-1.amazonaws.com"
REGION_INDEX = f"{PRICE_LIST}/offers/v1.0/aws/AmazonEC2/current/region_index.json"
SPOT_ADVISOR = "https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json"
LINUX = {"Product Family": "Compute Instance", "Operating System": "Linux", "Tenancy": "Shared",
         "Pre Installed S/W": "NA", "CapacityStatus": "Used", "License Model": "No License required",
         "MarketOption": "OnDemand", "Unit": "Hrs"}
LINUX_ON_DEMAND = {**LINUX, "TermType": "OnDemand"}
# the reserved price the catalog's reserved_discount stands for: 1 year, no upfront, standard
LINUX_RESERVED = {**LINUX, "TermType": "Reserved", "LeaseContractLength": "1yr", "PurchaseOption": "No Upfront",
                  "OfferingClass": "standard"}


class PriceSourceError(Exception):
    """A price source answered with something other than its documented format."""


class Unanswered(PriceSourceError):
    """The source has no price for this row (the row is left as it is, and said so)."""


class NotRecorded(Unanswered):
    """No recorded response for this request."""


class NotOffered(Unanswered):
    """The cloud does not sell the type there (Tencent: InvalidInstanceType*, ResourceInsufficient*, ...)."""


NOT_OFFERED = ("InvalidInstanceType", "ResourceInsufficient", "ResourcesSoldOut", "InvalidZone",
               "InvalidParameterValue.InstanceTypeNotSupported")


@dataclass(frozen=True)
class Offer:
    """On-demand prices of one AWS region's offer file."""

    version: str
    date: str  # publication date, YYYY-MM-DD
    prices: dict[str, float]  # instance type -> USD per hour
    reserved: dict[str, float] = field(default_factory=dict)  # type -> USD per hour, 1 year no upfront


def aws_offer(lines: Iterable[str], region: str, types: set[str]) -> Offer:
    """The plain Linux on-demand hourly price of `types` in an EC2 offer file (CSV), streamed."""
    it = iter(lines)
    meta: dict[str, str] = {}
    for _ in range(5):
        pair = next(csv.reader([next(it, "")]), [])
        if len(pair) == 2:
            meta[pair[0]] = pair[1]
    if "Publication Date" not in meta or "Version" not in meta:
        raise PriceSourceError("not an AWS offer file: its first rows hold no Publication Date and Version")
    prices: dict[str, float] = {}
    reserved: dict[str, float] = {}
    seen = 0
    for row in csv.DictReader(it):
        if row.get("Region Code") != region:
            continue
        seen += 1
        if row.get("Instance Type") not in types:
            continue
        for wanted, into in ((LINUX_ON_DEMAND, prices), (LINUX_RESERVED, reserved)):
            if all(row.get(k) == v for k, v in wanted.items()):
                amount = _amount(row, region)
                if amount > 0:
                    into[row["Instance Type"]] = amount
    if not seen:
        raise PriceSourceError(f"offer file {region}: no row for the region at all (a truncated download, or "
                               "another region's file)")
    date = meta["Publication Date"][:10]
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        raise PriceSourceError(f"offer file {region}: Publication Date {meta['Publication Date']!r} is not a date") \
            from None
    return Offer(meta["Version"], date, prices, reserved)


def _amount(row: dict[str, str], region: str) -> float:
    try:
        return float(row["PricePerUnit"])
    except (TypeError, ValueError):
        raise PriceSourceError(f"offer file {region}: PricePerUnit {row.get('PricePerUnit')!r} of "
                               f"{row['Instance Type']} is not a number") from None


def aws_spot(advisor: dict[str, Any], region: str, types: set[str]) -> dict[str, tuple[float, str]]:
    """type -> (spot discount off on-demand, interruption band) from the Spot Advisor feed."""
    try:
        labels = {int(r["index"]): str(r["label"]) for r in advisor["ranges"]}
        linux = advisor["spot_advisor"].get(region, {}).get("Linux", {})
        return {t: (int(v["s"]) / 100, labels[int(v["r"])]) for t, v in linux.items() if t in types}
    except (KeyError, TypeError, ValueError) as exc:
        raise PriceSourceError(f"not the Spot Advisor's format: {exc!r}") from None


def alicloud_price(body: dict[str, Any]) -> tuple[float, str]:
    """(instance price per hour, currency) from a DescribePrice response body."""
    try:
        price = body["PriceInfo"]["Price"]
        details = price.get("DetailInfos") or {}
        entries = details.get("DetailInfo") or details.get("ResourcePriceModel") or []
        own = [e for e in entries if str(e.get("Resource", "")).lower() == "instancetype"]
        return float((own[0] if own else price)["TradePrice"]), str(price["Currency"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise PriceSourceError(f"not a DescribePrice response: {exc!r}") from None


def alicloud_spot(body: dict[str, Any], instance_type: str) -> float:
    """The spot discount off pay-as-you-go from a DescribeSpotPriceHistory response: 1 - the mean
    of SpotPrice / OriginPrice over the type's entries (the last 3 hours by default)."""
    try:
        entries = [e for e in body["SpotPrices"]["SpotPriceType"] if e.get("InstanceType") == instance_type]
        ratios = [float(e["SpotPrice"]) / float(e["OriginPrice"]) for e in entries if float(e["OriginPrice"]) > 0]
    except (KeyError, TypeError, ValueError) as exc:
        raise PriceSourceError(f"not a DescribeSpotPriceHistory response: {exc!r}") from None
    if not ratios:
        raise NotOffered(f"DescribeSpotPriceHistory lists no spot price of {instance_type}")
    return round(1 - sum(ratios) / len(ratios), 2)


def tencentcloud_price(body: dict[str, Any]) -> float:
    """The hourly instance price from an InquiryPriceRunInstances response."""
    response = body.get("Response", {}) if isinstance(body, dict) else {}
    if "Error" in response:
        error = response["Error"]
        code = str(error.get("Code", ""))
        kind = NotOffered if code.startswith(NOT_OFFERED) else PriceSourceError
        raise kind(f"InquiryPriceRunInstances: {code}: {error.get('Message')}")
    try:
        item = response["Price"]["InstancePrice"]
        if item.get("ChargeUnit") != "HOUR":
            raise PriceSourceError(f"InquiryPriceRunInstances: ChargeUnit {item.get('ChargeUnit')!r}, not HOUR")
        return float(item["UnitPriceDiscount"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PriceSourceError(f"not an InquiryPriceRunInstances response: {exc!r}") from None


class Source(Protocol):
    def for_cloud(self, cloud: str) -> Source:
        """The source as one cloud's refresh asks it (a recorded folder: that cloud's subfolder)."""
        ...

    def aws_offer_lines(self, region: str) -> Iterator[str]: ...
    def aws_spot_advisor(self) -> dict[str, Any]: ...
    def alicloud_describe_price(self, region: str, instance_type: str) -> dict[str, Any]: ...
    def alicloud_spot_history(self, region: str, zone: str, instance_type: str) -> dict[str, Any]: ...
    def tencentcloud_inquiry(self, region: str, zone: str, instance_type: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Recorded:
    """Responses recorded in each API's format, one subfolder per cloud (its name): aws/offer-<region>.csv,
    aws/spot-advisor-data.json, alicloud/<region>/<type>.json, tencentcloud/<region>/<type>.json.
    `for_cloud(name)` is the view a cloud's refresh reads (infra/prices/refresh.py hands it on)."""

    folder: Path
    cloud: str = ""

    def for_cloud(self, cloud: str) -> Recorded:
        return Recorded(self.folder, cloud)

    def _read(self, *parts: str) -> str:
        if not self.cloud:
            raise NotRecorded(f"{self.folder}: no cloud chosen (Recorded.for_cloud)")
        path = self.folder.joinpath(self.cloud, *parts)
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NotRecorded(f"no recorded response {path.relative_to(self.folder)}") from None

    def _json(self, *parts: str) -> dict[str, Any]:
        try:
            return dict(json.loads(self._read(*parts)))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise PriceSourceError(f"recorded response {'/'.join((self.cloud, *parts))} is not a JSON object: {exc}") from None

    def aws_offer_lines(self, region: str) -> Iterator[str]:
        return iter(self._read(f"offer-{region}.csv").splitlines())

    def aws_spot_advisor(self) -> dict[str, Any]:
        return self._json("spot-advisor-data.json")

    def alicloud_describe_price(self, region: str, instance_type: str) -> dict[str, Any]:
        return self._json(region, f"{instance_type}.json")

    def alicloud_spot_history(self, region: str, zone: str, instance_type: str) -> dict[str, Any]:
        return self._json(region, f"{instance_type}.spot.json")

    def tencentcloud_inquiry(self, region: str, zone: str, instance_type: str) -> dict[str, Any]:
        return self._json(region, f"{instance_type}.json")


F = TypeVar("F", bound=Callable[..., Any])


def _answer(what: str) -> Callable[[F], F]:
    """A Live call's failure (network, HTTP, the SDKs' own errors, an unexpected shape) as one
    PriceSourceError naming the call; the cloud's own not-offered codes as NotOffered."""
    def wrap(call: F) -> F:
        @functools.wraps(call)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except PriceSourceError:
                raise
            except Exception as exc:  # noqa: BLE001 (urllib, http.client and the SDKs raise their own kinds)
                code = str(getattr(exc, "code", "") or "")
                kind = NotOffered if code.startswith(NOT_OFFERED) else PriceSourceError
                raise kind(f"{what}: {type(exc).__name__}: {exc}") from None
        return cast(F, inner)
    return wrap


class Live:
    """The clouds themselves: AWS's public files over HTTPS; Alibaba and Tencent through their SDKs
    with the credentials in the environment (ALIBABA_CLOUD_ACCESS_KEY_ID / _SECRET,
    TENCENTCLOUD_SECRET_ID / _KEY)."""

    def for_cloud(self, cloud: str) -> Live:
        return self  # each method asks its own cloud

    def _get(self, url: str) -> Any:
        import urllib.request

        return urllib.request.urlopen(url, timeout=120)  # noqa: S310 (fixed https URLs of the price lists)

    @_answer("AWS Price List region index")
    def aws_offer_lines(self, region: str) -> Iterator[str]:
        index = json.load(self._get(REGION_INDEX))
        if region not in index.get("regions", {}):
            raise NotOffered(f"the EC2 price list has no region {region}")
        path = index["regions"][region]["currentVersionUrl"].replace("index.json", "index.csv")
        return self._lines(f"{PRICE_LIST}{path}")

    def _lines(self, url: str) -> Iterator[str]:
        try:
            for raw in self._get(url):
                yield raw.decode("utf-8").rstrip("\r\n")
        except Exception as exc:  # noqa: BLE001 (a cut download: http.client.IncompleteRead is no OSError)
            raise PriceSourceError(f"AWS offer file {url}: {type(exc).__name__}: {exc}") from None

    @_answer("AWS Spot Advisor feed")
    def aws_spot_advisor(self) -> dict[str, Any]:
        return dict(json.load(self._get(SPOT_ADVISOR)))

    @_answer("Alibaba Cloud DescribePrice")
    def alicloud_describe_price(self, region: str, instance_type: str) -> dict[str, Any]:
        from alibabacloud_ecs20140526 import models
        from alibabacloud_ecs20140526.client import Client

        request = models.DescribePriceRequest(region_id=region, resource_type="instance", instance_type=instance_type,
                                              price_unit="Hour", period=1)
        return dict(Client(self._alicloud(region)).describe_price(request).to_map()["body"])

    @_answer("Alibaba Cloud DescribeSpotPriceHistory")
    def alicloud_spot_history(self, region: str, zone: str, instance_type: str) -> dict[str, Any]:
        from alibabacloud_ecs20140526 import models
        from alibabacloud_ecs20140526.client import Client

        request = models.DescribeSpotPriceHistoryRequest(region_id=region, zone_id=zone, instance_type=instance_type,
                                                         network_type="vpc", ostype="linux")
        return dict(Client(self._alicloud(region)).describe_spot_price_history(request).to_map()["body"])

    @staticmethod
    def _alicloud(region: str) -> Any:
        from alibabacloud_tea_openapi import models as openapi

        return openapi.Config(access_key_id=_env("ALIBABA_CLOUD_ACCESS_KEY_ID"),
                              access_key_secret=_env("ALIBABA_CLOUD_ACCESS_KEY_SECRET"),
                              endpoint=f"ecs.{region}.aliyuncs.com")

    @_answer("Tencent Cloud InquiryPriceRunInstances")
    def tencentcloud_inquiry(self, region: str, zone: str, instance_type: str) -> dict[str, Any]:
        from tencentcloud.common import credential
        from tencentcloud.cvm.v20170312 import cvm_client, models

        client = cvm_client.CvmClient(credential.Credential(_env("TENCENTCLOUD_SECRET_ID"),
                                                            _env("TENCENTCLOUD_SECRET_KEY")), region)
        images = models.DescribeImagesRequest()
        images.from_json_string(json.dumps({"Filters": [{"Name": "image-type", "Values": ["PUBLIC_IMAGE"]},
                                                        {"Name": "platform", "Values": ["Ubuntu"]}], "Limit": 1}))
        image = client.DescribeImages(images).ImageSet[0].ImageId  # any Linux image: the price is the instance's
        request = models.InquiryPriceRunInstancesRequest()
        request.from_json_string(json.dumps({"Placement": {"Zone": zone}, "ImageId": image, "InstanceType": instance_type,
                                             "InstanceChargeType": "POSTPAID_BY_HOUR"}))
        return {"Response": json.loads(client.InquiryPriceRunInstances(request).to_json_string())}


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise PriceSourceError(f"{name} is not set: the price API needs the account's credentials (read-only "
                               "pricing access is enough)")
    return value
