"""Tencent Cloud on the node: the spot notice (in Beijing time), the AS replace-me call and a TKE
pod's own CAM role; its registry needs no login.

Node-side, standard library only, and it imports nothing: training/cloudmeta.py `cloud_node` loads
it by path and hands it `cloudmeta` (the generic primitives). Imported the ordinary way it has
no `cloudmeta`, and its calls fail (NameError). The node bundle carries it
(/usr/local/lib/gts/clouds/tencentcloud/node.py), the trainer image too; the interface: cloudmeta
`CloudNode`. The metadata service itself and COS reads: metadata.py beside it.

Replacing a node: AS RemoveInstances(AutoScalingGroupId, InstanceIds), API 3.0 2018-04-19,
TC3-HMAC-SHA256. The metadata service names no scaling group, and user data is rendered before
the group exists: the plan writes the group's id to nodes/scaling-groups/<group> in the stack's
bucket once the group exists (infra/clouds/tencentcloud/health.py), and the node reads it with its
role (the grant it has for its bundle). RemoveInstances' documentation (377/20431) does not say
what happens to the desired capacity (ScaleInInstances and EnterStandby say they lower it), so
the node reads DesiredCapacity first (DescribeAutoScalingGroups) and sets it back afterwards
(ModifyDesiredCapacity): the group backfills either way.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Callable, Any, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:  # handed in by cloud_node at load time
    from training import cloudmeta

NAME = "tencentcloud"
# cloud.tencent.com/document/product/213/4934 (spot/termination-time, placement/region)
SPOT_PATH = "/latest/meta-data/spot/termination-time"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
REGION_PATH = "/latest/meta-data/placement/region"
POD_IDENTITY: Optional[str] = "tke-pod-identity"
BEIJING = dt.timezone(dt.timedelta(hours=8))
GROUP_ID = re.compile(r"asg-[a-z0-9]+")  # an AS group's id, as CreateAutoScalingGroup returns it
STS = "https://sts.tencentcloudapi.com"
# What TKE's pod-identity webhook sets in a pod whose service account is annotated
# tke.cloud.tencent.com/role-arn (TKE "Pod identity", document/product/457/57285; the Tencent
# SDKs' DefaultTkeOIDCRoleArnProvider reads the same four).
IDENTITY_VARS = ("TKE_REGION", "TKE_PROVIDER_ID", "TKE_ROLE_ARN", "TKE_WEB_IDENTITY_TOKEN_FILE")
log = logging.getLogger("gts-gpu-health")


def spot_deadline(body: str) -> Optional[dt.datetime]:
    """2026-01-01 08:00:00 (Beijing time)"""
    try:
        return dt.datetime.strptime(body, "%Y-%m-%d %H:%M:%S").replace(tzinfo=BEIJING).astimezone(dt.timezone.utc)
    except (ValueError, TypeError):
        return None


def other_notice(meta: cloudmeta.Metadata) -> Tuple[Optional[str], Optional[str], Optional[dt.datetime]]:
    return None, None, None  # the spot notice is the only one


def registry_login(meta: cloudmeta.Metadata, region: str, endpoint: Optional[str]) -> Optional[Tuple[str, str, str]]:
    return None  # TCR serves the stack's VPCs without credentials (infra/clouds/tencentcloud/registry.py)


def replace_api_url(region: str) -> str:
    # One endpoint for every region (API 3.0): the region goes in the X-TC-Region header (`call`).
    return "https://as.tencentcloudapi.com/"


def call(creds: cloudmeta.Credentials, region: str, action: str, params: Dict[str, Any], url: str,
         now: dt.datetime, service: str = "as", version: str = "2018-04-19") -> urllib.request.Request:
    """One Tencent Cloud API 3.0 call (by default service as, version 2018-04-19), signed TC3-HMAC-SHA256."""
    host = urllib.parse.urlsplit(url).netloc
    body = json.dumps(params).encode()
    content = "application/json; charset=utf-8"
    day, stamp = now.strftime("%Y-%m-%d"), str(int(now.timestamp()))
    canonical = "\n".join(["POST", "/", "", "content-type:%s\nhost:%s\n" % (content, host), "content-type;host",
                           hashlib.sha256(body).hexdigest()])
    scope = "%s/%s/tc3_request" % (day, service)
    to_sign = "\n".join(["TC3-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("TC3" + creds.secret_key).encode()
    for part in (day, service, "tc3_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {"Content-Type": content, "X-TC-Action": action, "X-TC-Version": version,
               "X-TC-Timestamp": stamp, "X-TC-Region": region, "X-TC-Token": creds.token,
               "Authorization": "TC3-HMAC-SHA256 Credential=%s/%s, SignedHeaders=content-type;host, Signature=%s"
                                % (creds.access_key, scope, signature)}
    return urllib.request.Request(url, data=body, headers=headers, method="POST")


def answer(req: urllib.request.Request, timeout: float = 30) -> Dict[str, Any]:
    """The Response object of a Tencent API call; its Error raised."""
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        found: Dict[str, Any] = json.loads(resp.read().decode()).get("Response", {})
    if "Error" in found:
        raise ValueError("%s answered %s" % (req.get_header("X-tc-action"), found["Error"]))
    return found


def rendezvous_key(meta: cloudmeta.Metadata, region: str, ref: str, endpoint: Optional[str] = None) -> str:
    """The group's rendezvous key: SSM GetSecretValue(SecretName, VersionId), 2019-09-23,
    document/api/1078/38649 (infra/clouds/tencentcloud/secrets.py puts it there, version v1)."""
    request = call(meta.credentials(), region, "GetSecretValue", {"SecretName": ref, "VersionId": "v1"},
                   endpoint or "https://ssm.tencentcloudapi.com/", dt.datetime.now(dt.timezone.utc),
                   service="ssm", version="2019-09-23")
    return str(answer(request)["SecretString"])


def group_id_key(group: str) -> str:
    """Where the plan writes a group's scaling-group id (infra/clouds/tencentcloud/health.py)."""
    return "nodes/scaling-groups/%s" % group


def read_group_id(group: str, creds: cloudmeta.Credentials) -> str:
    """The object the plan wrote beside the node bundle, read with the node's role like the
    bundle (bucket and endpoint from node.env)."""
    env = os.environ.get
    bucket = urllib.parse.urlsplit(env("GTS_BUNDLE_URL", "")).netloc
    endpoint = env("STORAGE_ENDPOINT_URL")
    if not (bucket and endpoint and group):
        raise ValueError("no scaling-group id: --group-id is empty and node.env names no bucket (GTS_BUNDLE_URL, "
                         "STORAGE_ENDPOINT_URL) or group (GTS_NODE_GROUP)")
    body = cloudmeta.signed_get(NAME, endpoint, env("STORAGE_REGION", ""), bucket, group_id_key(group), creds,
                                env("STORAGE_ADDRESSING_STYLE", "virtual"))
    group_id = body.decode().strip()
    if not GROUP_ID.fullmatch(group_id):
        raise ValueError("%s holds %r, not a scaling-group id" % (group_id_key(group), group_id[:60]))
    return group_id


def replace_self(creds: cloudmeta.Credentials, region: str, instance: str, url: str, group: str,
                 group_id: str) -> str:
    """DescribeAutoScalingGroups (the desired capacity now), RemoveInstances, then
    ModifyDesiredCapacity back to it: the group launches a replacement whether or not
    RemoveInstances lowered the desired capacity (its documentation does not say). The group's
    id: --group-id, else the plan's object in the bucket."""
    def now() -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)

    group_id = group_id or read_group_id(group, creds)
    found = answer(call(creds, region, "DescribeAutoScalingGroups", {"AutoScalingGroupIds": [group_id]}, url, now()))
    groups = found.get("AutoScalingGroupSet") or []
    if len(groups) != 1:
        raise ValueError("DescribeAutoScalingGroups found %d groups with id %s" % (len(groups), group_id))
    desired = int(groups[0]["DesiredCapacity"])
    removed = answer(call(creds, region, "RemoveInstances", {"AutoScalingGroupId": group_id, "InstanceIds": [instance]},
                          url, now()))
    try:
        answer(call(creds, region, "ModifyDesiredCapacity", {"AutoScalingGroupId": group_id,
                                                             "DesiredCapacity": desired}, url, now()))
    except (OSError, ValueError) as exc:  # the node is removed already: say so, do not remove it again
        log.error("RemoveInstances done, but setting the desired capacity of %s back to %d failed: %s",
                  group_id, desired, exc)
    return json.dumps({"RemoveInstances": removed, "DesiredCapacity": desired})


def group_id_problem(group_id: str) -> Optional[str]:
    return None if not group_id or GROUP_ID.fullmatch(group_id) else "must be an AS group id (asg-...)"


def pod_identity_credentials(env: Mapping[str, str], token: Callable[[str], str], sts_url: Callable[[str, str], str],
                             timeout: float) -> cloudmeta.Credentials:
    """TKE pod identity: exchange the pod's projected service-account token for its CAM role's
    credentials at Tencent STS AssumeRoleWithWebIdentity (version 2018-08-13). Not signed (the
    token is the proof): a TC3-style JSON POST with `Authorization: SKIP`, as the Tencent SDKs
    send it (tencentcloud-sdk-python common/credential.py OIDCRoleArnCredential with SkipSign,
    common/abstract_client.py). GTS_STS_ENDPOINT overrides the endpoint (tests)."""
    missing = [k for k in IDENTITY_VARS if not env.get(k)]
    if missing:
        raise cloudmeta.MetadataError("tke-pod-identity credentials need %s (TKE's pod-identity webhook sets them in "
                                      "pods of a service account annotated tke.cloud.tencent.com/role-arn)"
                                      % ", ".join(missing))
    proof = token("TKE_WEB_IDENTITY_TOKEN_FILE")
    body = json.dumps({"ProviderId": env["TKE_PROVIDER_ID"], "WebIdentityToken": proof, "RoleArn": env["TKE_ROLE_ARN"],
                       "RoleSessionName": "gpu-training-stack", "DurationSeconds": 3600}).encode()
    endpoint = env.get("GTS_STS_ENDPOINT") or STS
    url = sts_url(endpoint, "GTS_STS_ENDPOINT") + "/"
    headers = {"Content-Type": "application/json", "Authorization": "SKIP",
               "X-TC-Action": "AssumeRoleWithWebIdentity", "X-TC-Version": "2018-08-13",
               "X-TC-Region": env["TKE_REGION"], "X-TC-Timestamp": str(int(time.time()))}
    what = "tencentcloud STS %s AssumeRoleWithWebIdentity" % endpoint
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method="POST"),
                                    timeout=timeout) as resp:
            doc = json.loads(resp.read().decode())["Response"]
        if "Error" in doc:  # Tencent API errors come back with HTTP 200
            raise cloudmeta.MetadataError("%s refused: %s: %s" % (what, doc["Error"].get("Code"),
                                                                  doc["Error"].get("Message")))
        found = doc["Credentials"]
        return cloudmeta.Credentials(str(found["TmpSecretId"]), str(found["TmpSecretKey"]), str(found["Token"]),
                                     float(doc["ExpiredTime"]))
    except urllib.error.HTTPError as err:
        raise cloudmeta.MetadataError("%s answered HTTP %d" % (what, err.code)) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise cloudmeta.MetadataError("%s did not return credentials: %r" % (what, exc)) from None
