"""Alibaba Cloud on the node: the ECS metadata service (hardened mode), the RAM role's credentials,
OSS reads (S3 signature v2), the spot notice, the ESS replace-me call and an ACK pod's own RAM
role (RRSA).

Node-side: standard library only, and it imports nothing — training/cloudmeta.py `cloud_node`
loads it by path and hands it `cloudmeta` (the generic primitives). The user data of an Alibaba
node writes it to /usr/local/lib/gts/clouds/alicloud.py; the trainer image has it at its
repository path. The interface it answers: training/cloudmeta.py `CloudNode`.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:  # handed in by cloud_node at load time
    from training import cloudmeta

NAME = "alicloud"
# Hardened mode and RAM role credentials: aliyun/credentials-python provider/ecs_ram_role.py;
# alibabacloud.com/help/en/ecs/user-guide/obtain-a-temporary-authorization-token
METADATA_URL = "http://100.100.100.200"
SPOT_PATH = "/latest/meta-data/instance/spot/termination-time"
CREDENTIALS_PATH = "/latest/meta-data/ram/security-credentials/"
TOKEN_TTL_HEADER: Optional[str] = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER: Optional[str] = "X-aliyun-ecs-metadata-token"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
REGION_PATH = "/latest/meta-data/region-id"
POD_IDENTITY: Optional[str] = "ack-rrsa"
STS = "https://sts.aliyuncs.com"


def role_credentials(doc: Dict[str, object]) -> cloudmeta.Credentials:
    """{"Code", "AccessKeyId", "AccessKeySecret", "SecurityToken", "Expiration": "...Z"}"""
    if doc.get("Code") != "Success":
        raise ValueError("Code is %r" % doc.get("Code"))
    return cloudmeta.Credentials(str(doc["AccessKeyId"]), str(doc["AccessKeySecret"]), str(doc["SecurityToken"]),
                                 cloudmeta.utc_seconds(str(doc["Expiration"])))


def sign_object_get(url: str, bucket: str, region: str, creds: cloudmeta.Credentials,
                    now: dt.datetime) -> Dict[str, str]:
    """S3 signature version 2 (the one OSS's S3 API is reached with here, as botocore's
    signature_version="s3"), for a request without body or content type."""
    parts = urllib.parse.urlsplit(url)
    date = now.strftime("%a, %d %b %Y %H:%M:%S GMT")
    headers = {"Date": date}
    amz = ""
    if creds.token:
        headers["x-amz-security-token"] = creds.token
        amz = "x-amz-security-token:%s\n" % creds.token
    # The resource is /<bucket>/<key> in either addressing style.
    resource = "/" + bucket + parts.path if parts.netloc.startswith(bucket + ".") else parts.path
    to_sign = "GET\n\n\n%s\n%s%s" % (date, amz, resource)
    digest = hmac.new(creds.secret_key.encode(), to_sign.encode(), hashlib.sha1).digest()
    headers["Authorization"] = "AWS %s:%s" % (creds.access_key, base64.b64encode(digest).decode())
    return headers


def spot_deadline(body: str) -> Optional[dt.datetime]:
    """2026-01-01T00:00:00Z (UTC)"""
    try:
        return dt.datetime.strptime(body, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except (ValueError, TypeError):
        return None


def other_notice(meta: cloudmeta.Metadata) -> Tuple[Optional[str], Optional[str], Optional[dt.datetime]]:
    return None, None, None  # the spot notice is the only one


def registry_login(meta: cloudmeta.Metadata, region: str, endpoint: Optional[str]) -> Optional[Tuple[str, str, str]]:
    return None  # ACR serves the stack's VPCs without credentials (infra/clouds/alicloud/registry.py)


def replace_api_url(region: str) -> str:
    return "https://ess.%s.aliyuncs.com/" % region


def _percent(text: object) -> str:
    """Alibaba RPC percent-encoding: RFC 3986 unreserved characters stay."""
    return urllib.parse.quote(str(text), safe="-_.~")


def set_unhealthy(creds: cloudmeta.Credentials, region: str, instance: str, url: str,
                  now: dt.datetime) -> urllib.request.Request:
    """ESS SetInstanceHealth(InstanceId, Unhealthy), RPC API 2014-08-28, signature v1 (HMAC-SHA1)."""
    params = {"Action": "SetInstanceHealth", "Version": "2014-08-28", "RegionId": region, "InstanceId": instance,
              "HealthStatus": "Unhealthy", "Format": "JSON", "AccessKeyId": creds.access_key,
              "SecurityToken": creds.token, "SignatureMethod": "HMAC-SHA1", "SignatureVersion": "1.0",
              "SignatureNonce": uuid.uuid4().hex, "Timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    query = "&".join("%s=%s" % (_percent(k), _percent(v)) for k, v in sorted(params.items()))
    to_sign = "GET&%2F&" + _percent(query)
    digest = hmac.new((creds.secret_key + "&").encode(), to_sign.encode(), hashlib.sha1).digest()
    signature = _percent(base64.b64encode(digest).decode())
    return urllib.request.Request("%s/?%s&Signature=%s" % (url.rstrip("/"), query, signature), method="GET")


def replace_self(creds: cloudmeta.Credentials, region: str, instance: str, url: str, group: str,
                 group_id: str) -> str:
    """"The scaling group detects and removes unhealthy instances" (and launches replacements)."""
    request = set_unhealthy(creds, region, instance, url, dt.datetime.now(dt.timezone.utc))
    with urllib.request.urlopen(request, timeout=30) as resp:
        return str(resp.read().decode())


def group_id_problem(group_id: str) -> Optional[str]:
    return None  # the node's group is its own (SetInstanceHealth names the instance only)


def pod_identity_credentials(env: Mapping[str, str], timeout: float) -> cloudmeta.Credentials:
    """ACK RRSA: exchange the pod's projected service-account token for the role's credentials
    (Alibaba STS AssumeRoleWithOIDC: no signature, the token is the proof)."""
    role = env.get("ALIBABA_CLOUD_ROLE_ARN", "")
    provider = env.get("ALIBABA_CLOUD_OIDC_PROVIDER_ARN", "")
    if not (role and provider and env.get("ALIBABA_CLOUD_OIDC_TOKEN_FILE", "")):
        raise cloudmeta.MetadataError("ack-rrsa credentials need ALIBABA_CLOUD_ROLE_ARN, "
                                      "ALIBABA_CLOUD_OIDC_PROVIDER_ARN and ALIBABA_CLOUD_OIDC_TOKEN_FILE (the Job sets them)")
    token = cloudmeta.service_account_token(env, "ALIBABA_CLOUD_OIDC_TOKEN_FILE")
    query = urllib.parse.urlencode({
        "Action": "AssumeRoleWithOIDC", "Format": "JSON", "Version": "2015-04-01", "RoleArn": role,
        "OIDCProviderArn": provider, "OIDCToken": token, "RoleSessionName": "gpu-training-stack",
        "DurationSeconds": "3600", "Timestamp": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    endpoint = env.get("ALIBABA_CLOUD_STS_ENDPOINT") or STS
    url = cloudmeta.sts_url(endpoint, "ALIBABA_CLOUD_STS_ENDPOINT") + "/?" + query
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=timeout) as resp:
            doc = json.loads(resp.read().decode())
        found = doc["Credentials"]
        return cloudmeta.Credentials(str(found["AccessKeyId"]), str(found["AccessKeySecret"]),
                                     str(found["SecurityToken"]), cloudmeta.utc_seconds(str(found["Expiration"])))
    except urllib.error.HTTPError as err:
        raise cloudmeta.MetadataError("alicloud STS %s AssumeRoleWithOIDC answered HTTP %d" % (endpoint, err.code)) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise cloudmeta.MetadataError("alicloud STS %s AssumeRoleWithOIDC did not return credentials: %s"
                                      % (endpoint, exc)) from None
