"""Where the trainer's bucket credentials come from (STORAGE_CREDENTIALS in the contract):
`instance-role` (the ECS RAM / CVM CAM role from the metadata service), `ack-rrsa` (an ACK
pod's own RAM role, by its projected service-account token), `tke-pod-identity` (a TKE pod's
own CAM role, the same way) or `default` (the AWS SDK chain finds the EC2 instance role and EKS
Pod Identity itself). training/storage.py turns the
function chosen here into refreshing botocore credentials."""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping

from training.cloudmeta import CLOUDS, Credentials, Metadata, MetadataError, utc_seconds
from training.contract import CREDENTIAL_SOURCES

ACK_STS = "https://sts.aliyuncs.com"
TKE_STS = "https://sts.tencentcloudapi.com"
# What TKE's pod-identity webhook sets in a pod whose service account is annotated
# tke.cloud.tencent.com/role-arn (TKE "Pod identity", document/product/457/57285; the Tencent
# SDKs' DefaultTkeOIDCRoleArnProvider reads the same four).
TKE_IDENTITY_VARS = ("TKE_REGION", "TKE_PROVIDER_ID", "TKE_ROLE_ARN", "TKE_WEB_IDENTITY_TOKEN_FILE")


def _token(env: Mapping[str, str], var: str) -> str:
    """The pod's projected service-account token, from the file `var` names (read on every call:
    Kubernetes rotates it)."""
    try:
        with open(env[var], encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise MetadataError(f"{var}={env[var]!r}: the pod's service-account token cannot be read "
                            f"({exc.strerror}); the pod's identity webhook mounts it") from None


def _sts_url(endpoint: str, var: str) -> str:
    """An STS endpoint the token may be sent to: https, or plain http on loopback (tests)."""
    url = endpoint if "://" in endpoint else "https://" + endpoint
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise MetadataError(f"{var}={endpoint!r}: the pod's token goes to STS over https only")
    return url.rstrip("/")


def assume_role_with_oidc(env: Mapping[str, str], timeout: float = 10.0) -> Credentials:
    """ACK RRSA: exchange the pod's projected service-account token for the role's credentials
    (Alibaba STS AssumeRoleWithOIDC: no signature, the token is the proof). The token file is
    read on every call: Kubernetes rotates it."""
    role = env.get("ALIBABA_CLOUD_ROLE_ARN", "")
    provider = env.get("ALIBABA_CLOUD_OIDC_PROVIDER_ARN", "")
    token_file = env.get("ALIBABA_CLOUD_OIDC_TOKEN_FILE", "")
    if not (role and provider and token_file):
        raise MetadataError("ack-rrsa credentials need ALIBABA_CLOUD_ROLE_ARN, ALIBABA_CLOUD_OIDC_PROVIDER_ARN and "
                            "ALIBABA_CLOUD_OIDC_TOKEN_FILE (the Job sets them)")
    token = _token(env, "ALIBABA_CLOUD_OIDC_TOKEN_FILE")
    query = urllib.parse.urlencode({
        "Action": "AssumeRoleWithOIDC", "Format": "JSON", "Version": "2015-04-01", "RoleArn": role,
        "OIDCProviderArn": provider, "OIDCToken": token, "RoleSessionName": "gpu-training-stack",
        "DurationSeconds": "3600", "Timestamp": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    endpoint = env.get("ALIBABA_CLOUD_STS_ENDPOINT") or ACK_STS
    url = _sts_url(endpoint, "ALIBABA_CLOUD_STS_ENDPOINT") + "/?" + query
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=timeout) as resp:
            doc = json.loads(resp.read().decode())
        found = doc["Credentials"]
        return Credentials(str(found["AccessKeyId"]), str(found["AccessKeySecret"]), str(found["SecurityToken"]),
                           utc_seconds(str(found["Expiration"])))
    except urllib.error.HTTPError as err:
        raise MetadataError(f"alicloud STS {endpoint} AssumeRoleWithOIDC answered HTTP {err.code}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise MetadataError(f"alicloud STS {endpoint} AssumeRoleWithOIDC did not return credentials: {exc}") from None


def assume_role_with_web_identity(env: Mapping[str, str], timeout: float = 10.0) -> Credentials:
    """TKE pod identity: exchange the pod's projected service-account token for its CAM role's
    credentials at Tencent STS AssumeRoleWithWebIdentity (version 2018-08-13). Not signed (the
    token is the proof): a TC3-style JSON POST with `Authorization: SKIP`, as the Tencent SDKs
    send it (tencentcloud-sdk-python common/credential.py OIDCRoleArnCredential with SkipSign,
    common/abstract_client.py).
    GTS_STS_ENDPOINT overrides the endpoint (tests)."""
    missing = [k for k in TKE_IDENTITY_VARS if not env.get(k)]
    if missing:
        raise MetadataError(f"tke-pod-identity credentials need {', '.join(missing)} (TKE's pod-identity webhook sets "
                            "them in pods of a service account annotated tke.cloud.tencent.com/role-arn)")
    token = _token(env, "TKE_WEB_IDENTITY_TOKEN_FILE")
    body = json.dumps({"ProviderId": env["TKE_PROVIDER_ID"], "WebIdentityToken": token, "RoleArn": env["TKE_ROLE_ARN"],
                       "RoleSessionName": "gpu-training-stack", "DurationSeconds": 3600}).encode()
    endpoint = env.get("GTS_STS_ENDPOINT") or TKE_STS
    url = _sts_url(endpoint, "GTS_STS_ENDPOINT") + "/"
    headers = {"Content-Type": "application/json", "Authorization": "SKIP",
               "X-TC-Action": "AssumeRoleWithWebIdentity", "X-TC-Version": "2018-08-13",
               "X-TC-Region": env["TKE_REGION"], "X-TC-Timestamp": str(int(time.time()))}
    what = f"tencentcloud STS {endpoint} AssumeRoleWithWebIdentity"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method="POST"),
                                    timeout=timeout) as resp:
            doc = json.loads(resp.read().decode())["Response"]
        if "Error" in doc:  # Tencent API errors come back with HTTP 200
            raise MetadataError(f"{what} refused: {doc['Error'].get('Code')}: {doc['Error'].get('Message')}")
        found = doc["Credentials"]
        return Credentials(str(found["TmpSecretId"]), str(found["TmpSecretKey"]), str(found["Token"]),
                           float(doc["ExpiredTime"]))
    except urllib.error.HTTPError as err:
        raise MetadataError(f"{what} answered HTTP {err.code}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MetadataError(f"{what} did not return credentials: {exc!r}") from None


def credential_source(source: str, env: Mapping[str, str]) -> Callable[[], Credentials]:
    """The function that gives fresh credentials for STORAGE_CREDENTIALS=`source` (not `default`:
    botocore's own chain serves that)."""
    if source == "instance-role":
        cloud = env.get("GTS_CLOUD", "")
        if cloud not in CLOUDS:
            raise MetadataError(f"instance-role credentials need GTS_CLOUD (aws, alicloud or tencentcloud), not {cloud!r}")
        return Metadata(cloud, env.get("GTS_METADATA_URL") or None).credentials
    if source == "ack-rrsa":
        return lambda: assume_role_with_oidc(env)
    if source == "tke-pod-identity":
        return lambda: assume_role_with_web_identity(env)
    raise ValueError(f"STORAGE_CREDENTIALS={source!r}: use one of {', '.join(CREDENTIAL_SOURCES)}")
