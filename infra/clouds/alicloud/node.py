"""Alibaba Cloud on the node: the spot notice, the ESS replace-me call and an ACK pod's own RAM
role (RRSA); its registry needs no login.

Node-side, standard library only, and it imports nothing: training/cloudmeta.py `cloud_node` loads
it by path and hands it `cloudmeta` (the generic primitives). Imported the ordinary way it has
no `cloudmeta`, and its calls fail (NameError). The node bundle carries it
(/usr/local/lib/gts/clouds/alicloud/node.py), the trainer image too; the interface: cloudmeta
`CloudNode`. The metadata service itself and OSS reads: metadata.py beside it.
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
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Tuple

if TYPE_CHECKING:  # handed in by cloud_node at load time
    from training import cloudmeta

NAME = "alicloud"
# alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata (instance/spot/termination-time, region-id)
SPOT_PATH = "/latest/meta-data/instance/spot/termination-time"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
REGION_PATH = "/latest/meta-data/region-id"
POD_IDENTITY: Optional[str] = "ack-rrsa"
STS = "https://sts.aliyuncs.com"


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
    return rpc_request(creds, url, now, {"Action": "SetInstanceHealth", "Version": "2014-08-28", "RegionId": region,
                                         "InstanceId": instance, "HealthStatus": "Unhealthy"})


def rpc_request(creds: cloudmeta.Credentials, url: str, now: dt.datetime,
                call: Mapping[str, str]) -> urllib.request.Request:
    """A GET of one RPC-style API call (Action, Version and its parameters), signature v1 (HMAC-SHA1)."""
    params = {**call, "Format": "JSON", "AccessKeyId": creds.access_key,
              "SecurityToken": creds.token, "SignatureMethod": "HMAC-SHA1", "SignatureVersion": "1.0",
              "SignatureNonce": uuid.uuid4().hex, "Timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    query = "&".join("%s=%s" % (_percent(k), _percent(v)) for k, v in sorted(params.items()))
    to_sign = "GET&%2F&" + _percent(query)
    digest = hmac.new((creds.secret_key + "&").encode(), to_sign.encode(), hashlib.sha1).digest()
    signature = _percent(base64.b64encode(digest).decode())
    return urllib.request.Request("%s/?%s&Signature=%s" % (url.rstrip("/"), query, signature), method="GET")


def rendezvous_key(meta: cloudmeta.Metadata, region: str, ref: str, endpoint: Optional[str] = None) -> str:
    """The group's rendezvous key: OOS GetSecretParameter(Name, WithDecryption), RPC API 2019-06-01
    (infra/clouds/alicloud/secrets.py puts it there, readable by this group's role alone)."""
    url = endpoint or "https://oos.%s.aliyuncs.com/" % region
    request = rpc_request(meta.credentials(), url, dt.datetime.now(dt.timezone.utc),
                          {"Action": "GetSecretParameter", "Version": "2019-06-01", "RegionId": region,
                           "Name": ref, "WithDecryption": "true"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return str(json.loads(resp.read().decode())["Parameter"]["Value"])


def replace_self(creds: cloudmeta.Credentials, region: str, instance: str, url: str, group: str,
                 group_id: str) -> str:
    """"The scaling group detects and removes unhealthy instances" (and launches replacements)."""
    request = set_unhealthy(creds, region, instance, url, dt.datetime.now(dt.timezone.utc))
    with urllib.request.urlopen(request, timeout=30) as resp:
        return str(resp.read().decode())


def group_id_problem(group_id: str) -> Optional[str]:
    return None  # the node's group is its own (SetInstanceHealth names the instance only)


def pod_identity_credentials(env: Mapping[str, str], token: Callable[[str], str], sts_url: Callable[[str, str], str],
                             timeout: float) -> cloudmeta.Credentials:
    """ACK RRSA: exchange the pod's projected service-account token for the role's credentials
    (Alibaba STS AssumeRoleWithOIDC: no signature, the token is the proof)."""
    role = env.get("ALIBABA_CLOUD_ROLE_ARN", "")
    provider = env.get("ALIBABA_CLOUD_OIDC_PROVIDER_ARN", "")
    if not (role and provider and env.get("ALIBABA_CLOUD_OIDC_TOKEN_FILE", "")):
        raise cloudmeta.MetadataError("ack-rrsa credentials need ALIBABA_CLOUD_ROLE_ARN, "
                                      "ALIBABA_CLOUD_OIDC_PROVIDER_ARN and ALIBABA_CLOUD_OIDC_TOKEN_FILE (the Job sets them)")
    proof = token("ALIBABA_CLOUD_OIDC_TOKEN_FILE")
    query = urllib.parse.urlencode({
        "Action": "AssumeRoleWithOIDC", "Format": "JSON", "Version": "2015-04-01", "RoleArn": role,
        "OIDCProviderArn": provider, "OIDCToken": proof, "RoleSessionName": "gpu-training-stack",
        "DurationSeconds": "3600", "Timestamp": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    endpoint = env.get("ALIBABA_CLOUD_STS_ENDPOINT") or STS
    url = sts_url(endpoint, "ALIBABA_CLOUD_STS_ENDPOINT") + "/?" + query
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
