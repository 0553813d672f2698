"""AWS's instance metadata service (IMDSv2) and S3, as the node's fetcher reads them: the instance
role's credentials and a signed GET of the node bundle.

Node-side, standard library only, and it imports nothing: training/cloudmeta.py `cloud_metadata`
loads it by path and hands it `cloudmeta` (the generic primitives). Imported the ordinary way it has
no `cloudmeta`, and its calls fail (NameError). The user data of an AWS node
carries it (/usr/local/lib/gts/clouds/aws/metadata.py); the interface: cloudmeta `CloudMetadata`.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:  # handed in by cloud_metadata at load time
    from training import cloudmeta

NAME = "aws"
# docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html, iam-roles-for-amazon-ec2.html
METADATA_URL = "http://169.254.169.254"
CREDENTIALS_PATH = "/latest/meta-data/iam/security-credentials/"
# the instance's zone (the peer tier's buddies): docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html
ZONE_PATH = "/latest/meta-data/placement/availability-zone"
TOKEN_TTL_HEADER: Optional[str] = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER: Optional[str] = "X-aws-ec2-metadata-token"


def role_credentials(doc: Dict[str, object]) -> cloudmeta.Credentials:
    """{"Code": "Success", "AccessKeyId", "SecretAccessKey", "Token", "Expiration": "...Z"}"""
    if doc.get("Code", "Success") != "Success":
        raise ValueError("Code is %r" % doc.get("Code"))
    return cloudmeta.Credentials(str(doc["AccessKeyId"]), str(doc["SecretAccessKey"]), str(doc["Token"]),
                                 cloudmeta.utc_seconds(str(doc["Expiration"])))


def sign_object_get(url: str, bucket: str, region: str, creds: cloudmeta.Credentials,
                    now: dt.datetime) -> Dict[str, str]:
    return cloudmeta.sign_v4("GET", url, region, creds, now)
