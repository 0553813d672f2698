"""A group-wide budget on replacement requests: before a node asks its scaling group to replace
it (the GPU gate's node fault, the Xid watch's replace class: cloudinit/scripts/gts-gpu-health.py
`leave`, the one caller of training/node/node_replace.py), it takes a slot, at most
`per_hour` slots per group per clock hour (UTC). Over budget, or when the budget cannot be read,
the node is quarantined instead (trainer off, a journal line, gts_gpu_quarantined): a fault of
ours (a bad image, a broken gate, a driver that condemns every GPU) then costs the group a few
nodes an hour, never the fleet.

The slots are objects in the run's bucket, under the group's checkpoint prefix (CHECKPOINT_URL,
which the node's role may write): `<prefix>replacements/<hour>/slot-<i>`, i < per_hour, each
created only if absent, so two nodes never hold one slot and N + 2 nodes asking at once get N:

- s3://   PutObject with `If-None-Match: *` (412 when it exists; AWS S3 conditional writes,
          as training/lease.py takes its lease; moto honours it: tests/test_replace_budget.py);
- oss://  `x-oss-forbid-overwrite: true` (409 FileAlreadyExists), signed as OSS's S3 API is
          reached here (signature version 2, training/storage.py);
- cosn:// `x-cos-forbid-overwrite: true` (409), Signature V4.
The OSS and COS headers are their documented ones (training/lease.py cites them); neither
store is reachable here, so only S3 is tested. A fixed clock hour lets a burst across the hour's
end take up to 2 x per_hour in a few minutes; the bound is per hour, not per sliding hour.

Node-side, standard library only (installed beside node_replace.py by the bundle).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:
    from training import cloudmeta
else:  # on a node, /usr/local/lib/gts (on sys.path) holds both files
    import cloudmeta

DEFAULT_PER_HOUR = 3  # GTS_REPLACEMENTS_PER_HOUR; 0: no bound
WINDOW_S = 3600
CONFLICT = (409, 412)  # the slot exists: another node holds it
# scheme -> the header that makes a PUT create-only (see the module docstring)
CREATE_ONLY = {"s3": ("if-none-match", "*"), "oss": ("x-oss-forbid-overwrite", "true"),
               "cosn": ("x-cos-forbid-overwrite", "true")}


class Unreachable(Exception):
    """The budget could not be read or written: the caller fails safe (quarantine, no replacement)."""


def _sign_v2_put(url: str, bucket: str, creds: cloudmeta.Credentials, now: dt.datetime,
                 content_type: str) -> Dict[str, str]:
    """S3 signature version 2 for a PUT (OSS's S3 API as the trainer reaches it: signature_version
    "s3"); only x-amz-* headers are signed, as botocore's HmacV1 does."""
    parts = urllib.parse.urlsplit(url)
    date = now.strftime("%a, %d %b %Y %H:%M:%S GMT")
    headers = {"Date": date, "Content-Type": content_type}
    amz = ""
    if creds.token:
        headers["x-amz-security-token"] = creds.token
        amz = "x-amz-security-token:%s\n" % creds.token
    resource = "/" + bucket + parts.path if parts.netloc.startswith(bucket + ".") else parts.path
    to_sign = "PUT\n\n%s\n%s\n%s%s" % (content_type, date, amz, resource)
    digest = hmac.new(creds.secret_key.encode(), to_sign.encode(), hashlib.sha1).digest()
    headers["Authorization"] = "AWS %s:%s" % (creds.access_key, base64.b64encode(digest).decode())
    return headers


def create_only(place: Mapping[str, str], key: str, body: bytes, creds: cloudmeta.Credentials) -> bool:
    """PUT `key` into the run's bucket (`where`) unless it exists: True when created, False when
    another writer has it; Unreachable on anything else."""
    scheme, bucket = place["scheme"], place["bucket"]
    url = cloudmeta.object_url(place["endpoint"], bucket, key, place.get("style") or "virtual")
    now = dt.datetime.now(dt.timezone.utc)
    name, value = CREATE_ONLY[scheme]
    content = "application/json"
    if scheme == "oss":
        headers = _sign_v2_put(url, bucket, creds, now, content)
        headers[name] = value
    else:
        headers = cloudmeta.sign_v4("PUT", url, place["region"], creds, now, body=body,
                                    extra={name: value, "content-type": content})
    headers.pop("host", None)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method="PUT"),
                                    timeout=15):
            return True
    except urllib.error.HTTPError as exc:
        if exc.code in CONFLICT:
            return False
        raise Unreachable("%s answered %d %s" % (url, exc.code, exc.read().decode(errors="replace")[:200])) from None
    except OSError as exc:
        raise Unreachable("%s: %s" % (url, exc)) from None


def where(env: Mapping[str, str]) -> Dict[str, str]:
    """The budget's place from the node's env (node.env: CHECKPOINT_URL, STORAGE_ENDPOINT_URL,
    STORAGE_REGION, STORAGE_ADDRESSING_STYLE); Unreachable when the node has no run bucket."""
    url = env.get("CHECKPOINT_URL", "")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in CREATE_ONLY or not parts.netloc or not env.get("STORAGE_ENDPOINT_URL"):
        raise Unreachable("the node has no run bucket to keep the budget in (CHECKPOINT_URL %r, "
                          "STORAGE_ENDPOINT_URL %r)" % (url, env.get("STORAGE_ENDPOINT_URL", "")))
    prefix = parts.path.lstrip("/")
    return {"scheme": parts.scheme, "bucket": parts.netloc, "prefix": prefix + ("" if prefix.endswith("/") else "/"),
            "endpoint": env["STORAGE_ENDPOINT_URL"], "region": env.get("STORAGE_REGION", ""),
            "style": env.get("STORAGE_ADDRESSING_STYLE", "virtual")}


def take(env: Mapping[str, str], per_hour: int, instance: str, reason: str, creds: cloudmeta.Credentials,
         now: Callable[[], float] = time.time) -> Tuple[bool, str]:
    """(True, the slot's key) once this node holds a slot of this hour; (False, what is spent)
    when all `per_hour` are held. Raises Unreachable (the caller quarantines)."""
    place = where(env)
    hour = int(now() // WINDOW_S)
    body = json.dumps({"instance": instance, "reason": reason, "at": int(now())}).encode()
    for i in range(per_hour):
        key = "%sreplacements/%010d/slot-%d" % (place["prefix"], hour, i)
        if create_only(place, key, body, creds):
            return True, key
    started = dt.datetime.fromtimestamp(hour * WINDOW_S, dt.timezone.utc).strftime("%H:%M UTC")
    return False, "all %d replacement slots of the hour from %s are taken (%s://%s/%sreplacements/%010d/)" % (
        per_hour, started, place["scheme"], place["bucket"], place["prefix"], hour)


def per_hour_setting(value: Optional[str]) -> int:
    """GTS_REPLACEMENTS_PER_HOUR as a count (ValueError names what is allowed)."""
    if value in (None, ""):
        return DEFAULT_PER_HOUR
    count = int(str(value))
    if count < 0:
        raise ValueError("must be 0 (no bound) or more")
    return count
