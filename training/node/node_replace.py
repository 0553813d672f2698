"""A node asks its own group to replace it: each cloud's call, signed with the instance role's
credentials from the metadata service (training/cloudmeta.py), with the standard library only.

Node-side: the bundle installs it beside cloudmeta.py in /usr/local/lib/gts, and
cloudinit/scripts/gts-gpu-health.py imports it.

Handing the node back, signed with the instance role's credentials from the metadata service:
  AWS      autoscaling SetInstanceHealth(InstanceId, Unhealthy, ShouldRespectGracePeriod=false),
           query API 2011-01-01, Signature V4 — "Amazon EC2 Auto Scaling terminates and replaces
           the unhealthy instance";
  Alibaba  ESS SetInstanceHealth(InstanceId, Unhealthy), RPC API 2014-08-28, signature v1
           (HMAC-SHA1) — "the scaling group detects and removes unhealthy instances";
  Tencent  AS RemoveInstances(AutoScalingGroupId, InstanceIds), API 3.0 2018-04-19, TC3-HMAC-SHA256.
           The metadata service names no scaling group, and user data is rendered before the
           group exists: the plan writes the group's id to nodes/scaling-groups/<group> in the
           stack's bucket once the group exists, and the node reads it with its role (the grant
           it has for its bundle). RemoveInstances' documentation (377/20431) does not say what
           happens to the desired capacity (ScaleInInstances and EnterStandby say they lower it),
           so the node reads DesiredCapacity first (DescribeAutoScalingGroups) and sets it back
           afterwards (ModifyDesiredCapacity): the group backfills either way.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import re
import urllib.parse
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

if TYPE_CHECKING:
    from training import cloudmeta
else:  # on a node, /usr/local/lib/gts (on sys.path) holds both files
    import cloudmeta

log = logging.getLogger("gts-gpu-health")

# Where each cloud's metadata service names the instance and its region.
INSTANCE_ID = {"aws": "/latest/meta-data/instance-id", "alicloud": "/latest/meta-data/instance-id",
               "tencentcloud": "/latest/meta-data/instance-id"}
REGION = {"aws": "/latest/meta-data/placement/region", "alicloud": "/latest/meta-data/region-id",
          "tencentcloud": "/latest/meta-data/placement/region"}
TENCENT_GROUP_ID = re.compile(r"asg-[a-z0-9]+")  # an AS group's id, as CreateAutoScalingGroup returns it


def _percent(text: object) -> str:
    """Alibaba RPC percent-encoding: RFC 3986 unreserved characters stay."""
    return urllib.parse.quote(str(text), safe="-_.~")


def aws_set_unhealthy(creds: cloudmeta.Credentials, region: str, instance: str, url: str,
                      now: dt.datetime) -> urllib.request.Request:
    body = urllib.parse.urlencode({"Action": "SetInstanceHealth", "Version": "2011-01-01", "InstanceId": instance,
                                   "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": "false"}).encode()
    content = "application/x-www-form-urlencoded; charset=utf-8"
    headers = cloudmeta.sign_v4("POST", url, region, creds, now, service="autoscaling", body=body,
                                extra={"content-type": content})
    headers.pop("host", None)
    return urllib.request.Request(url, data=body, headers=headers, method="POST")


def alicloud_set_unhealthy(creds: cloudmeta.Credentials, region: str, instance: str, url: str,
                           now: dt.datetime) -> urllib.request.Request:
    params = {"Action": "SetInstanceHealth", "Version": "2014-08-28", "RegionId": region, "InstanceId": instance,
              "HealthStatus": "Unhealthy", "Format": "JSON", "AccessKeyId": creds.access_key,
              "SecurityToken": creds.token, "SignatureMethod": "HMAC-SHA1", "SignatureVersion": "1.0",
              "SignatureNonce": uuid.uuid4().hex, "Timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    query = "&".join(f"{_percent(k)}={_percent(v)}" for k, v in sorted(params.items()))
    to_sign = "GET&%2F&" + _percent(query)
    digest = hmac.new((creds.secret_key + "&").encode(), to_sign.encode(), hashlib.sha1).digest()
    signature = _percent(base64.b64encode(digest).decode())
    return urllib.request.Request(f"{url.rstrip('/')}/?{query}&Signature={signature}", method="GET")


def tencent_call(creds: cloudmeta.Credentials, region: str, action: str, params: Dict[str, Any], url: str,
                 now: dt.datetime) -> urllib.request.Request:
    """One Tencent Cloud API 3.0 call (service as, version 2018-04-19), signed TC3-HMAC-SHA256."""
    host = urllib.parse.urlsplit(url).netloc
    body = json.dumps(params).encode()
    content = "application/json; charset=utf-8"
    day, stamp = now.strftime("%Y-%m-%d"), str(int(now.timestamp()))
    canonical = "\n".join(["POST", "/", "", f"content-type:{content}\nhost:{host}\n", "content-type;host",
                           hashlib.sha256(body).hexdigest()])
    scope = f"{day}/as/tc3_request"
    to_sign = "\n".join(["TC3-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("TC3" + creds.secret_key).encode()
    for part in (day, "as", "tc3_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {"Content-Type": content, "X-TC-Action": action, "X-TC-Version": "2018-04-19",
               "X-TC-Timestamp": stamp, "X-TC-Region": region, "X-TC-Token": creds.token,
               "Authorization": f"TC3-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                f"SignedHeaders=content-type;host, Signature={signature}"}
    return urllib.request.Request(url, data=body, headers=headers, method="POST")


def tencent_answer(req: urllib.request.Request, timeout: float = 30) -> Dict[str, Any]:
    """The Response object of a Tencent API call; its Error raised."""
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: Dict[str, Any] = json.loads(resp.read().decode()).get("Response", {})
    if "Error" in answer:
        raise ValueError(f"{req.get_header('X-tc-action')} answered {answer['Error']}")
    return answer


def group_id_key(group: str) -> str:
    """Where the plan writes a Tencent group's scaling-group id (infra/clouds/tencentcloud/health.py)."""
    return f"nodes/scaling-groups/{group}"


def tencent_group_id(args: Any, creds: cloudmeta.Credentials) -> str:
    """The scaling group's id: --group-id, else the object the plan wrote beside the node bundle,
    read with the node's role like the bundle (bucket and endpoint from node.env)."""
    if args.group_id:
        return str(args.group_id)
    env = os.environ.get
    bucket = urllib.parse.urlsplit(env("GTS_BUNDLE_URL", "")).netloc
    endpoint = env("STORAGE_ENDPOINT_URL")
    if not (bucket and endpoint and args.group):
        raise ValueError("no scaling-group id: --group-id is empty and node.env names no bucket (GTS_BUNDLE_URL, "
                         "STORAGE_ENDPOINT_URL) or group (GTS_NODE_GROUP)")
    body = cloudmeta.signed_get("tencentcloud", endpoint, env("STORAGE_REGION", ""), bucket,
                                group_id_key(args.group), creds, env("STORAGE_ADDRESSING_STYLE", "virtual"))
    group_id = body.decode().strip()
    if not TENCENT_GROUP_ID.fullmatch(group_id):
        raise ValueError(f"{group_id_key(args.group)} holds {group_id[:60]!r}, not a scaling-group id")
    return group_id


def tencent_replace(creds: cloudmeta.Credentials, region: str, instance: str, group_id: str, url: str) -> str:
    """DescribeAutoScalingGroups (the desired capacity now), RemoveInstances, then
    ModifyDesiredCapacity back to it: the group launches a replacement whether or not
    RemoveInstances lowered the desired capacity (its documentation does not say)."""
    def now() -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)

    found = tencent_answer(tencent_call(creds, region, "DescribeAutoScalingGroups",
                                        {"AutoScalingGroupIds": [group_id]}, url, now()))
    groups = found.get("AutoScalingGroupSet") or []
    if len(groups) != 1:
        raise ValueError(f"DescribeAutoScalingGroups found {len(groups)} groups with id {group_id}")
    desired = int(groups[0]["DesiredCapacity"])
    removed = tencent_answer(tencent_call(creds, region, "RemoveInstances",
                                          {"AutoScalingGroupId": group_id, "InstanceIds": [instance]}, url, now()))
    try:
        tencent_answer(tencent_call(creds, region, "ModifyDesiredCapacity",
                                    {"AutoScalingGroupId": group_id, "DesiredCapacity": desired}, url, now()))
    except (OSError, ValueError) as exc:  # the node is removed already: say so, do not remove it again
        log.error("RemoveInstances done, but setting the desired capacity of %s back to %d failed: %s",
                  group_id, desired, exc)
    return json.dumps({"RemoveInstances": removed, "DesiredCapacity": desired})


def api_url(cloud: str, region: str, override: Optional[str]) -> str:
    if override:
        return override.rstrip("/") + "/"
    return {"aws": f"https://autoscaling.{region}.amazonaws.com/", "alicloud": f"https://ess.{region}.aliyuncs.com/",
            "tencentcloud": "https://as.tencentcloudapi.com/"}[cloud]


def _send(req: urllib.request.Request) -> str:
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(resp.read().decode())


def request_replacement(cloud: str, meta: cloudmeta.Metadata, region_override: Optional[str],
                        url_override: Optional[str], group_id: Callable[[cloudmeta.Credentials], str]
                        ) -> "tuple[str, str]":
    """Ask `cloud`'s group to replace this instance: (instance id, the cloud's answer). Raises
    OSError / ValueError / KeyError / cloudmeta.MetadataError on a failure (the caller retries)."""
    instance, region = meta.get(INSTANCE_ID[cloud]), region_override or meta.get(REGION[cloud])
    if not (instance and region):
        raise ValueError(f"the metadata service names no instance id or region (instance {instance!r}, "
                         f"region {region!r})")
    creds = meta.credentials()
    now = dt.datetime.now(dt.timezone.utc)
    url = api_url(cloud, region, url_override)
    if cloud == "aws":
        return instance, _send(aws_set_unhealthy(creds, region, instance, url, now))
    if cloud == "alicloud":
        return instance, _send(alicloud_set_unhealthy(creds, region, instance, url, now))
    if cloud == "tencentcloud":
        return instance, tencent_replace(creds, region, instance, group_id(creds), url)
    raise ValueError(f"no replacement call for cloud {cloud!r}")
