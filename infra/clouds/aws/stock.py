"""Stock, quota and launch failures on AWS, asked of the cloud's own API through boto3
(infra/capacity/stock.py is the interface):

- EC2 DescribeInstanceTypeOfferings(LocationType=region | availability-zone, Filters
  instance-type, location): is the type sold there at all (EC2 API reference).
- Service Quotas GetServiceQuota(ServiceCode=ec2, QuotaCode): the account's vCPU quota for the
  family and market ("Running On-Demand G and VT instances", "All P Spot Instance Requests", ...;
  EC2 user guide "Spot Instance quotas", counted in vCPUs). The quota codes below are the ones
  the Service Quotas console lists; they are not checked against a live account here.
- EC2 GetSpotPlacementScores(InstanceTypes, TargetCapacity, TargetCapacityUnitType=units,
  SingleAvailabilityZone, RegionNames): 1-10, how likely a spot request of that size succeeds now
  (EC2 API reference; the response names zones by AvailabilityZoneId, so a zone's name is mapped
  with DescribeAvailabilityZones(ZoneNames)).
- EC2 Auto Scaling DescribeScalingActivities(AutoScalingGroupName, MaxRecords): the group's
  launches; a failed one whose StatusMessage names InsufficientInstanceCapacity is a capacity
  failure (EC2 Auto Scaling API reference; "Troubleshoot Amazon EC2 Auto Scaling"), unless a
  launch succeeded after it (a Successful activity whose Description starts "Launching"). The
  call has no time filter: `since` is applied to the answer.
- EC2 Auto Scaling DescribeAutoScalingGroups(AutoScalingGroupNames): the group is short when its
  InService instances are fewer than its DesiredCapacity; a full group is never moved.

At most four calls per candidate. moto (the tests' AWS) serves DescribeInstanceTypeOfferings and
DescribeAvailabilityZones; it has no GetSpotPlacementScores, no EC2 quotas and records no scaling
activities, so the tests answer those three with recorded responses (tests/data/capacity/aws/);
DescribeAutoScalingGroups is moto's own.
"""

from __future__ import annotations

from datetime import timezone
from typing import Any

from infra.capacity.stock import Ask, Failure, Verdict, newer

# A placement score under this (of 10) is "no stock": AWS calls low scores unlikely to be fulfilled.
MIN_SPOT_SCORE = 3
TIMEOUT_S = 4.0  # one call's read timeout (connect: half of it)
# Family letter -> (on-demand quota, spot quota), ServiceCode ec2.
QUOTA_CODES = {"g": ("L-DB2E81BA", "L-3819A6DF"), "p": ("L-417A185B", "L-7212CCBC")}
CAPACITY_MARKERS = ("InsufficientInstanceCapacity", "UnfulfillableCapacity", "MaxSpotInstanceCountExceeded",
                    "VcpuLimitExceeded", "InsufficientCapacity")


class AwsStock:
    def __init__(self, region: str, ec2: Any, autoscaling: Any, quotas: Any):
        self.region, self.ec2, self.autoscaling, self.quotas = region, ec2, autoscaling, quotas

    def ask(self, ask: Ask) -> Verdict:
        where = ask.zone or ask.region
        ask.timeout(TIMEOUT_S)  # before each call: none once the budget is spent (boto3's own timeouts bound each)
        offered = self._offered(ask, where)
        calls = 1
        if not offered:
            return Verdict(False, f"{'/'.join(ask.types)} not offered in {where} (DescribeInstanceTypeOfferings)", calls)
        ask.timeout(TIMEOUT_S)
        quota, calls = self._quota(offered[0], ask), calls + 1
        need = ask.nodes * ask.vcpus_of(offered[0])
        if quota is not None and quota < need:
            return Verdict(False, f"vCPU quota {quota:g} for {offered[0]} ({ask.market.type}) is under the {need} the "
                                  "nodes need (GetServiceQuota)", calls)
        if not ask.market.spot:  # EC2 has no on-demand stock API: offered within quota is not stock
            return Verdict(True, f"{offered[0]} offered in {where}, quota {quota if quota is not None else 'unknown'} "
                                 "(on-demand stock unknown)", calls, known=False)
        ask.timeout(TIMEOUT_S)
        score, used = self._score(ask, offered)
        calls += used
        if score < MIN_SPOT_SCORE:
            return Verdict(False, f"spot placement score {score} of 10 in {where} for {ask.nodes} node(s) "
                                  f"(GetSpotPlacementScores; under {MIN_SPOT_SCORE})", calls)
        return Verdict(True, f"spot placement score {score} of 10 in {where}", calls)

    def _offered(self, ask: Ask, where: str) -> list[str]:
        answer = self.ec2.describe_instance_type_offerings(
            LocationType="availability-zone" if ask.zone else "region",
            Filters=[{"Name": "instance-type", "Values": list(ask.types)}, {"Name": "location", "Values": [where]}])
        sold = {o["InstanceType"] for o in answer.get("InstanceTypeOfferings", [])}
        return [t for t in ask.types if t in sold]

    def _quota(self, itype: str, ask: Ask) -> float | None:
        codes = QUOTA_CODES.get(itype[:1].lower())
        if codes is None:
            return None
        code = codes[1] if ask.market.spot else codes[0]
        try:
            return float(self.quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except self.quotas.exceptions.NoSuchResourceException:
            return None

    def _score(self, ask: Ask, offered: list[str]) -> tuple[int, int]:
        zone_id, calls = None, 1
        if ask.zone:
            zones = self.ec2.describe_availability_zones(ZoneNames=[ask.zone])["AvailabilityZones"]
            zone_id, calls = (zones[0]["ZoneId"] if zones else None), 2
            ask.timeout(TIMEOUT_S)
        answer = self.ec2.get_spot_placement_scores(
            InstanceTypes=offered, TargetCapacity=max(ask.nodes, 1), TargetCapacityUnitType="units",
            SingleAvailabilityZone=bool(ask.zone), RegionNames=[ask.region])
        scores = [int(s["Score"]) for s in answer.get("SpotPlacementScores", [])
                  if s.get("Region") == ask.region and (zone_id is None or s.get("AvailabilityZoneId") == zone_id)]
        return max(scores, default=0), calls

    def failures(self, group_id: str, since: str | None = None) -> list[Failure]:
        answer = self.autoscaling.describe_scaling_activities(AutoScalingGroupName=group_id, MaxRecords=20)
        failed, launched = [], ""
        for act in answer.get("Activities", []):
            message = str(act.get("StatusMessage", ""))
            at = act.get("StartTime")
            stamp = _iso(at)
            if act.get("StatusCode") == "Successful" and str(act.get("Description", "")).startswith("Launching"):
                launched = max(launched, stamp)
            elif act.get("StatusCode") in ("Failed", "Cancelled") and any(m in message for m in CAPACITY_MARKERS):
                failed.append(Failure(stamp, message))
        return newer(failed, launched, since)

    def nodes(self, group_id: str) -> tuple[int, int]:
        groups = self.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group_id])["AutoScalingGroups"]
        if not groups:
            return 0, 0
        running = sum(1 for i in groups[0].get("Instances", []) if i.get("LifecycleState") == "InService")
        return running, int(groups[0].get("DesiredCapacity", 0))


def _iso(at: Any) -> str:
    """A UTC ISO 8601 stamp of botocore's datetime (or the text as given)."""
    if hasattr(at, "astimezone"):
        return str(at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return str(at or "")

def open_api(region: str, ec2: Any = None, autoscaling: Any = None, quotas: Any = None) -> AwsStock:
    """The region's clients (boto3's own credential chain), or the ones given."""
    import boto3
    from botocore.config import Config

    # Inside the broker's budget per place (infra/capacity/stock.py ASK_BUDGET_S): botocore's defaults
    # (60 s timeouts, retries) would leave an abandoned call running for minutes.
    config = Config(connect_timeout=TIMEOUT_S / 2, read_timeout=TIMEOUT_S, retries={"mode": "standard", "total_max_attempts": 2})
    return AwsStock(region, ec2 or boto3.client("ec2", region_name=region, config=config),
                    autoscaling or boto3.client("autoscaling", region_name=region, config=config),
                    quotas or boto3.client("service-quotas", region_name=region, config=config))
