"""Tencent Cloud's CVM metadata service and COS, as the node's fetcher reads them: the CAM role's
credentials and a signed GET of the node bundle (COS's S3 API, Signature V4).

Node-side, standard library only, and it imports nothing: training/cloudmeta.py `cloud_metadata`
loads it by path and hands it `cloudmeta` (the generic primitives). Imported the ordinary way it has
no `cloudmeta`, and its calls fail (NameError). The user data of a Tencent
node carries it (/usr/local/lib/gts/clouds/tencentcloud/metadata.py); the interface: cloudmeta
`CloudMetadata`.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:  # handed in by cloud_metadata at load time
    from training import cloudmeta

NAME = "tencentcloud"
# CAM role credentials: tencentcloud-sdk-go common/cvm_role_provider.go; cloud.tencent.com/document/product/213/4934
METADATA_URL = "http://metadata.tencentyun.com"
CREDENTIALS_PATH = "/latest/meta-data/cam/security-credentials/"
# the instance's zone (the peer tier's buddies): tencentcloud.com/document/product/213/4934 (placement/zone)
ZONE_PATH = "/latest/meta-data/placement/zone"
TOKEN_TTL_HEADER: Optional[str] = None  # no token handshake
TOKEN_HEADER: Optional[str] = None


def role_credentials(doc: Dict[str, object]) -> cloudmeta.Credentials:
    """{"Code", "TmpSecretId", "TmpSecretKey", "Token", "ExpiredTime": unix seconds}"""
    if doc.get("Code") != "Success":
        raise ValueError("Code is %r" % doc.get("Code"))
    return cloudmeta.Credentials(str(doc["TmpSecretId"]), str(doc["TmpSecretKey"]), str(doc["Token"]),
                                 float(doc["ExpiredTime"]))  # type: ignore[arg-type]


def sign_object_get(url: str, bucket: str, region: str, creds: cloudmeta.Credentials,
                    now: dt.datetime) -> Dict[str, str]:
    return cloudmeta.sign_v4("GET", url, region, creds, now)
