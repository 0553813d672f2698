"""Alibaba Cloud's ECS metadata service (hardened mode) and OSS, as the node's fetcher reads them:
the RAM role's credentials and a signed GET of the node bundle (S3 signature v2).

Node-side, standard library only, and it imports nothing: training/cloudmeta.py `cloud_metadata`
loads it by path and hands it `cloudmeta` (the generic primitives). Imported the ordinary way it has
no `cloudmeta`, and its calls fail (NameError). The user data of an Alibaba
node carries it (/usr/local/lib/gts/clouds/alicloud/metadata.py); the interface: cloudmeta
`CloudMetadata`.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import urllib.parse
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:  # handed in by cloud_metadata at load time
    from training import cloudmeta

NAME = "alicloud"
# Hardened mode and RAM role credentials: aliyun/credentials-python provider/ecs_ram_role.py;
# alibabacloud.com/help/en/ecs/user-guide/obtain-a-temporary-authorization-token
METADATA_URL = "http://100.100.100.200"
CREDENTIALS_PATH = "/latest/meta-data/ram/security-credentials/"
# the instance's zone (the peer tier's buddies): alibabacloud.com/help/en/ecs/user-guide/instance-metadata-items
ZONE_PATH = "/latest/meta-data/zone-id"
TOKEN_TTL_HEADER: Optional[str] = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER: Optional[str] = "X-aliyun-ecs-metadata-token"


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
