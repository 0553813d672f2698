"""AWS on the node: the spot, scale-in and rebalance notices, the ECR login, the Auto Scaling
replace-me call (and why a pod's own role needs nothing here).

Node-side, standard library only, and it imports nothing: training/cloudmeta.py `cloud_node` loads
it by path and hands it `cloudmeta` (the generic primitives). Imported the ordinary way it has
no `cloudmeta`, and its calls fail (NameError). The node bundle carries it
(/usr/local/lib/gts/clouds/aws/node.py), the trainer image too; the interface: cloudmeta
`CloudNode`. The metadata service itself and S3 reads: metadata.py beside it.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Tuple

if TYPE_CHECKING:  # handed in by cloud_node at load time
    from training import cloudmeta

NAME = "aws"
# docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html, instancedata-data-categories.html
SPOT_PATH = "/latest/meta-data/spot/instance-action"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
REGION_PATH = "/latest/meta-data/placement/region"
POD_IDENTITY: Optional[str] = None  # EKS Pod Identity: the SDK's default chain finds it itself
# An Auto Scaling scale-in, held by the group's lifecycle hook (infra/clouds/aws/fleet.py), and a
# rebalance recommendation (an elevated risk of interruption).
LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
SCALE_IN_NOTICE_S = 120.0  # how long a scale-in gives the trainer, well inside the hook's timeout
ECR_TARGET = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"


def spot_deadline(body: str) -> Optional[dt.datetime]:
    """{"action": "terminate", "time": "2026-01-01T00:00:00Z"}"""
    try:
        stamp = json.loads(body)["time"]
        return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except (ValueError, KeyError, TypeError):
        return None


def other_notice(meta: cloudmeta.Metadata) -> Tuple[Optional[str], Optional[str], Optional[dt.datetime]]:
    state = meta.get(LIFECYCLE_PATH, missing_ok=True)
    if state and state.strip() == "Terminated":
        return "scale-in", state.strip(), dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=SCALE_IN_NOTICE_S)
    rebalance = meta.get(REBALANCE_PATH, missing_ok=True)
    if rebalance:
        return "rebalance", rebalance, None
    return None, None, None


def registry_login(meta: cloudmeta.Metadata, region: str, endpoint: Optional[str]) -> Optional[Tuple[str, str, str]]:
    """ECR: GetAuthorizationToken signed by the instance role, in the region of the repository
    (the cloud's default region, with the stack's bucket)."""
    creds = meta.credentials()
    url = (endpoint or "https://api.ecr.%s.amazonaws.com" % region).rstrip("/") + "/"
    body = b"{}"
    extra = {"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": ECR_TARGET}
    headers = cloudmeta.sign_v4("POST", url, region, creds, dt.datetime.now(dt.timezone.utc), "ecr", body, extra)
    headers.pop("host", None)
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as resp:
        data = json.loads(resp.read().decode())["authorizationData"][0]
    user, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    return str(data["proxyEndpoint"]), user, password


def rendezvous_key(meta: cloudmeta.Metadata, region: str, ref: str, endpoint: Optional[str] = None) -> str:
    """The group's rendezvous key: SSM GetParameter(Name, WithDecryption) signed by the instance
    role (infra/clouds/aws/secrets.py puts it there, readable by this group's role alone)."""
    creds = meta.credentials()
    url = (endpoint or "https://ssm.%s.amazonaws.com" % region).rstrip("/") + "/"
    body = json.dumps({"Name": ref, "WithDecryption": True}).encode()
    extra = {"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": "AmazonSSM.GetParameter"}
    headers = cloudmeta.sign_v4("POST", url, region, creds, dt.datetime.now(dt.timezone.utc), "ssm", body, extra)
    headers.pop("host", None)
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as resp:
        return str(json.loads(resp.read().decode())["Parameter"]["Value"])


def replace_api_url(region: str) -> str:
    return "https://autoscaling.%s.amazonaws.com/" % region


def replace_self(creds: cloudmeta.Credentials, region: str, instance: str, url: str, group: str,
                 group_id: str) -> str:
    """Auto Scaling SetInstanceHealth(InstanceId, Unhealthy, ShouldRespectGracePeriod=false), query
    API 2011-01-01, Signature V4: "Amazon EC2 Auto Scaling terminates and replaces the unhealthy
    instance". The group is the instance's own: no id needed."""
    body = urllib.parse.urlencode({"Action": "SetInstanceHealth", "Version": "2011-01-01", "InstanceId": instance,
                                   "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": "false"}).encode()
    content = "application/x-www-form-urlencoded; charset=utf-8"
    headers = cloudmeta.sign_v4("POST", url, region, creds, dt.datetime.now(dt.timezone.utc), service="autoscaling",
                                body=body, extra={"content-type": content})
    headers.pop("host", None)
    with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method="POST"),
                                timeout=30) as resp:
        return str(resp.read().decode())


def group_id_problem(group_id: str) -> Optional[str]:
    return None  # the node's group is its own (SetInstanceHealth names the instance only)


def pod_identity_credentials(env: Mapping[str, str], token: Callable[[str], str], sts_url: Callable[[str, str], str],
                             timeout: float) -> cloudmeta.Credentials:
    raise cloudmeta.MetadataError("an EKS pod's own role comes through EKS Pod Identity, which the SDK's default "
                                  "chain reads (STORAGE_CREDENTIALS=default)")
