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
          as training/ckpt/lease.py takes its lease; moto honours it: tests/test_replace_budget.py);
- oss://  `x-oss-forbid-overwrite: true` (409 FileAlreadyExists), signed as OSS's S3 API is
          reached here (signature version 2, training/ckpt/storage.py);
- cosn:// `x-cos-forbid-overwrite: true` (409), Signature V4.
The run buckets on OSS and COS are versioned (infra/clouds/<cloud>/storage.py), and both stores
ignore their forbid-overwrite header on a bucket that has ever had versioning on
(training/ckpt/lease.py): every PUT there succeeds and adds a version. So on those two the node lists
the slot's versions after its PUT (ListObjectVersions, newest first) and holds the slot only when
the oldest version, the first writer's, names this instance; later writers' versions stay behind
it and never win. Tested with a stand-in bucket that ignores the header (and against moto for
S3); neither store is reachable here. A 5xx, a throttle or a lost connection is tried again with
backoff (ATTEMPTS), another 4xx is a verdict; a write whose answer was lost and whose retry finds
the slot taken is this node's when the slot names its instance. A fixed clock hour lets a burst
across the hour's end take up to 2 x per_hour in a few minutes; the bound is per hour, not per
sliding hour.

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
from xml.etree import ElementTree

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
# The run buckets of these stores are versioned (infra/clouds/<cloud>/storage.py), and their
# create-only headers are ignored on a bucket that has ever had versioning on: the slot is then
# the oldest version's writer's (_first_writer).
VERSIONED = ("oss", "cosn")
SUBRESOURCES = ("versionId", "versions")  # signed in OSS's signature version 2
ATTEMPTS = 5  # per slot, with backoff: a bucket's 5xx or a lost connection is not a verdict


class Unreachable(Exception):
    """The budget could not be read or written: the caller fails safe (quarantine, no replacement)."""


def _sign_v2(method: str, url: str, bucket: str, creds: cloudmeta.Credentials, now: dt.datetime,
             content_type: str = "") -> Dict[str, str]:
    """S3 signature version 2 (OSS's S3 API as the trainer reaches it: signature_version "s3");
    only x-amz-* headers and the sub-resources (versions, versionId) are signed, as botocore's
    HmacV1 does."""
    parts = urllib.parse.urlsplit(url)
    date = now.strftime("%a, %d %b %Y %H:%M:%S GMT")
    headers = {"Date": date, **({"Content-Type": content_type} if content_type else {})}
    amz = ""
    if creds.token:
        headers["x-amz-security-token"] = creds.token
        amz = "x-amz-security-token:%s\n" % creds.token
    resource = "/" + bucket + parts.path if parts.netloc.startswith(bucket + ".") else parts.path
    subs = sorted((k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True) if k in SUBRESOURCES)
    if subs:
        resource += "?" + "&".join(k + ("=" + v if v else "") for k, v in subs)
    to_sign = "%s\n\n%s\n%s\n%s%s" % (method, content_type, date, amz, resource)
    digest = hmac.new(creds.secret_key.encode(), to_sign.encode(), hashlib.sha1).digest()
    headers["Authorization"] = "AWS %s:%s" % (creds.access_key, base64.b64encode(digest).decode())
    return headers


def _send(method: str, place: Mapping[str, str], url: str, creds: cloudmeta.Credentials, body: bytes = b"",
          extra: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str], bytes]:
    """One signed request to the run's bucket: (response headers, body); urllib's errors as they come."""
    now = dt.datetime.now(dt.timezone.utc)
    content = "application/json" if method == "PUT" else ""
    if place["scheme"] == "oss":
        headers = {**_sign_v2(method, url, place["bucket"], creds, now, content), **(extra or {})}
    else:
        headers = cloudmeta.sign_v4(method, url, place["region"], creds, now, body=body,
                                    extra={**(extra or {}), **({"content-type": content} if content else {})})
    headers.pop("host", None)
    request = urllib.request.Request(url, data=body if method == "PUT" else None, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=15) as resp:
        return {k.lower(): v for k, v in resp.headers.items()}, resp.read()


class Conflict(Exception):
    """The create-only PUT found the slot taken (409 / 412)."""


def _retried(call: Callable[[], bytes], url: str, sleep: Callable[[float], None]) -> bytes:
    """`call()` until it answers: a 5xx, a throttle or no answer at all (timeout, connection) is
    tried again with backoff, ATTEMPTS times in all, then Unreachable; another 4xx is Unreachable
    at once (a verdict: credentials, policy, no bucket), a 409 / 412 is Conflict."""
    problem = ""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except urllib.error.HTTPError as exc:
            if exc.code in CONFLICT:
                raise Conflict() from None
            if exc.code < 500 and exc.code != 429:
                raise Unreachable("%s answered %d %s" % (url, exc.code, exc.read().decode(errors="replace")[:200])) \
                    from None
            problem = "%s answered %d" % (url, exc.code)
        except OSError as exc:
            problem = "%s: %s" % (url, exc)
        if attempt < ATTEMPTS:
            sleep(min(8.0, 0.5 * 2 ** attempt))
    raise Unreachable("%s (%d attempts)" % (problem, ATTEMPTS))


def create_only(place: Mapping[str, str], key: str, body: bytes, creds: cloudmeta.Credentials, instance: str,
                sleep: Callable[[float], None] = time.sleep) -> bool:
    """PUT `key` into the run's bucket (`where`) unless it exists: True when this node holds it,
    False when another writer has it; Unreachable when the store refuses or stays out of reach
    (_retried). An attempt without an answer may have created the slot: a conflict after one is
    this node's own slot when the slot's body names this instance."""
    url = cloudmeta.object_url(place["endpoint"], place["bucket"], key, place.get("style") or "virtual")
    name, value = CREATE_ONLY[place["scheme"]]
    attempts = []

    def put() -> bytes:
        attempts.append(url)
        return _send("PUT", place, url, creds, body, {name: value})[1]

    try:
        _retried(put, url, sleep)
    except Conflict:
        return len(attempts) > 1 and _holder(place, key, creds, sleep) == instance
    return _first_writer(place, key, creds, instance, sleep) if place["scheme"] in VERSIONED else True


def _holder(place: Mapping[str, str], key: str, creds: cloudmeta.Credentials, sleep: Callable[[float], None],
            version: str = "") -> str:
    """The instance a slot (or one version of it) names."""
    url = cloudmeta.object_url(place["endpoint"], place["bucket"], key, place.get("style") or "virtual")
    if version:
        url += "?versionId=" + urllib.parse.quote(version, safe="")
    try:
        data = _retried(lambda: _send("GET", place, url, creds)[1], url, sleep)
        return str(json.loads(data.decode()).get("instance", ""))
    except (Conflict, ValueError, AttributeError) as exc:
        raise Unreachable("%s: not a slot (%s)" % (url, exc or "409")) from None


def _first_writer(place: Mapping[str, str], key: str, creds: cloudmeta.Credentials, instance: str,
                  sleep: Callable[[float], None]) -> bool:
    """On a versioned bucket (OSS and COS ignore the create-only header there) every PUT creates a
    version: the slot is the first writer's, the oldest version (ListObjectVersions lists a key's
    versions newest first), and this node holds it only when that version names it."""
    base = cloudmeta.object_url(place["endpoint"], place["bucket"], "", place.get("style") or "virtual")
    url = base + "?versions&prefix=" + urllib.parse.quote(key, safe="")
    try:
        root = ElementTree.fromstring(_retried(lambda: _send("GET", place, url, creds)[1], url, sleep))
    except (Conflict, ElementTree.ParseError) as exc:
        raise Unreachable("%s: not a version listing (%s)" % (url, exc or "409")) from None
    ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    versions = [v.findtext(ns + "VersionId") or "" for v in root.iter(ns + "Version") if v.findtext(ns + "Key") == key]
    if not versions:
        raise Unreachable("%s lists no version of %s after this node wrote it" % (url, key))
    return _holder(place, key, creds, sleep, versions[-1]) == instance


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
         now: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> Tuple[bool, str]:
    """(True, the slot's key) once this node holds a slot of this hour; (False, what is spent)
    when all `per_hour` are held. Raises Unreachable (the caller quarantines)."""
    place = where(env)
    hour = int(now() // WINDOW_S)
    body = json.dumps({"instance": instance, "reason": reason, "at": int(now())}).encode()
    for i in range(per_hour):
        key = "%sreplacements/%010d/slot-%d" % (place["prefix"], hour, i)
        if create_only(place, key, body, creds, instance, sleep):
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
