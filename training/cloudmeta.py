"""The instance metadata service, the instance role's credentials, and signed reads from the
object store — generic, with the Python standard library only; what is one cloud's comes from
that cloud's node module (`CloudNode` below; `cloud_node(name)` finds it).

The user data carries this module and the node's own cloud module (nothing else of the node's
code): GPU hosts have python3 but no cloud SDK, and `python3 cloudmeta.py fetch-bundle` downloads
the node scripts from the stack's bucket. The spot watcher, the registry login, the GPU health
watch and the trainer (training/credentials.py, training/storage.py: refreshing botocore
credentials for s3://, oss:// and cosn://) use it too. Keep it small: every byte is in every
node's user data.

    python3 cloudmeta.py credentials --cloud tencentcloud        # print the role's credentials' expiry
    python3 cloudmeta.py fetch-bundle --env /etc/gpu-training/node.env --dest /
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import glob
import hashlib
import hmac
import importlib.util
import io
import json
import os
import re
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Tuple, cast


class CloudNode(Protocol):
    """What every cloud's node module (infra/clouds/<cloud>/node.py) defines: all that is one
    cloud's on the node side. Standard library only, and it imports nothing: `cloud_node` hands it
    this module as its global `cloudmeta` (Credentials, MetadataError, sign_v4, signed_get).
    tests/test_cloud_profiles.py checks that every cloud's module answers all of it."""

    NAME: str  # the cloud's key (GTS_CLOUD, --cloud)
    METADATA_URL: str  # the metadata service's base URL (the profile's metadata_url)
    SPOT_PATH: str  # the reclaim notice; 404 while there is none
    CREDENTIALS_PATH: str  # + role name -> the role's temporary credentials
    TOKEN_TTL_HEADER: Optional[str]  # PUT /latest/api/token with this header first (IMDSv2, hardened mode)
    TOKEN_HEADER: Optional[str]  # then send the token in this one
    INSTANCE_ID_PATH: str
    REGION_PATH: str
    POD_IDENTITY: Optional[str]  # the STORAGE_CREDENTIALS source of its pods' own role (None: the SDK's chain)

    def role_credentials(self, doc: Dict[str, object]) -> Credentials:
        """The role-credentials document in the cloud's format (raises KeyError / ValueError)."""

    def sign_object_get(self, url: str, bucket: str, region: str, creds: Credentials,
                        now: dt.datetime) -> Dict[str, str]:
        """The headers of a signed GET of one object from the cloud's S3-compatible API."""

    def spot_deadline(self, body: str) -> Optional[dt.datetime]:
        """When the instance goes, in UTC, from the body at SPOT_PATH (None: unreadable)."""

    def other_notice(self, meta: Metadata) -> Tuple[Optional[str], Optional[str], Optional[dt.datetime]]:
        """A notice besides the reclaim: (kind, body, when): "scale-in" (checkpoint and go) or
        "rebalance" (checkpoint now, go on); (None, None, None) when there is none."""

    def registry_login(self, meta: Metadata, region: str,
                       endpoint: Optional[str]) -> Optional[Tuple[str, str, str]]:
        """(registry, user, password) for `docker login`, or None: the registry needs no login."""

    def replace_api_url(self, region: str) -> str:
        """The endpoint of the API that replaces a node of the region's scaling groups."""

    def replace_self(self, creds: Credentials, region: str, instance: str, url: str, group: str,
                     group_id: str) -> str:
        """Ask the node's scaling group to replace this instance; the cloud's answer. Raises
        OSError / ValueError / KeyError / MetadataError (the caller retries)."""

    def group_id_problem(self, group_id: str) -> Optional[str]:
        """Why a scaling-group id given to the node is not one of this cloud's (None: fine)."""

    def pod_identity_credentials(self, env: Mapping[str, str], timeout: float) -> Credentials:
        """POD_IDENTITY's exchange: the pod's service-account token for its role's credentials."""


NODE_INTERFACE = tuple(sorted({*CloudNode.__annotations__,
                               *(n for n, v in vars(CloudNode).items() if callable(v) and not n.startswith("_"))}))
HERE = os.path.dirname(os.path.abspath(__file__))
# Where a cloud's node module is: on a node, beside this file (the user data writes
# /usr/local/lib/gts/clouds/<cloud>.py); in a checkout and the trainer image (/opt/gts), in the
# repository's own layout. Loaded by path: infra/'s packages (pulumi) are never imported.
NODE_PLACES = (os.path.join(HERE, "clouds", "%s.py"), os.path.join(os.path.dirname(HERE), "infra", "clouds", "%s", "node.py"))
CLOUD_NAME = re.compile(r"[a-z0-9]+")
_NODES: Dict[str, CloudNode] = {}


class UnknownCloud(ValueError):
    """A cloud name with no node module here."""


def known_clouds() -> List[str]:
    """The clouds whose node module is here."""
    found = {os.path.basename(os.path.dirname(p)) if p.endswith("node.py") else os.path.basename(p)[:-3]
             for place in NODE_PLACES for p in glob.glob(place % "*")}
    return sorted(n for n in found if CLOUD_NAME.fullmatch(n))


def cloud_node(name: str) -> CloudNode:
    """The cloud's node module (UnknownCloud for a name that has none here)."""
    if name in _NODES:
        return _NODES[name]
    paths = [place % name for place in NODE_PLACES] if CLOUD_NAME.fullmatch(name) else []
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        raise UnknownCloud("%r is not a cloud this node knows (known: %s; a cloud's node module is "
                           "infra/clouds/<cloud>/node.py)" % (name, ", ".join(known_clouds()) or "none"))
    spec = importlib.util.spec_from_file_location("gts_cloud_" + name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    setattr(module, "cloudmeta", sys.modules[__name__])  # its generic primitives, without an import
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    missing = [n for n in NODE_INTERFACE if not hasattr(module, n)]
    if missing or getattr(module, "NAME", None) != name:
        raise UnknownCloud("%s is not a whole node module of %r (missing: %s)" % (path, name, ", ".join(missing)))
    _NODES[name] = cast(CloudNode, module)
    return _NODES[name]


class MetadataError(RuntimeError):
    """The metadata service did not give what was asked: the message names the cloud and path."""


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str
    expires: float  # unix time

    def expiring(self, within: float = 300.0) -> bool:
        return time.time() > self.expires - within


class Metadata:
    """Reads one cloud's metadata service (a token first where the cloud requires one)."""

    def __init__(self, cloud: str, base_url: Optional[str] = None, timeout: float = 2.0):
        self.cloud = cloud
        self.node = cloud_node(cloud)
        self.base = (base_url or self.node.METADATA_URL).rstrip("/")
        self.timeout = timeout
        self._token: Optional[str] = None

    def _new_token(self) -> str:
        assert self.node.TOKEN_TTL_HEADER
        req = urllib.request.Request(self.base + "/latest/api/token", method="PUT",
                                     headers={self.node.TOKEN_TTL_HEADER: "21600"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return str(resp.read().decode().strip())

    def get(self, path: str, missing_ok: bool = False) -> Optional[str]:
        """The body at `path`; None for a 404 when `missing_ok`."""
        for attempt in (1, 2):
            headers = {}
            if self.node.TOKEN_HEADER:
                if self._token is None:
                    self._token = self._new_token()
                headers[self.node.TOKEN_HEADER] = self._token
            req = urllib.request.Request(self.base + path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return str(resp.read().decode().strip())
            except urllib.error.HTTPError as err:
                if err.code == 404 and missing_ok:
                    return None
                if err.code in (401, 403) and self.node.TOKEN_HEADER and attempt == 1:
                    self._token = None  # expired or revoked: one fresh token, then give up
                    continue
                raise MetadataError("%s metadata %s%s answered HTTP %d" % (self.cloud, self.base, path, err.code))
        raise MetadataError("%s metadata %s%s refused the token" % (self.cloud, self.base, path))

    def role_name(self) -> str:
        listing = self.get(self.node.CREDENTIALS_PATH) or ""
        names = [line.strip().rstrip("/") for line in listing.splitlines() if line.strip()]
        if not names:
            raise MetadataError("%s metadata %s%s lists no role: is an instance role attached?"
                                % (self.cloud, self.base, self.node.CREDENTIALS_PATH))
        return names[0]

    def credentials(self, role: Optional[str] = None) -> Credentials:
        path = self.node.CREDENTIALS_PATH + (role or self.role_name())
        body = self.get(path) or ""
        try:
            return self.node.role_credentials(json.loads(body))
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataError("%s metadata %s%s did not return role credentials in the documented format: %s"
                                % (self.cloud, self.base, path, exc)) from None


def utc_seconds(stamp: str) -> float:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


# ---------------------------------------------------------------------------- pod identities

def service_account_token(env: Mapping[str, str], var: str) -> str:
    """The pod's projected service-account token, from the file `var` names (read on every call:
    Kubernetes rotates it)."""
    try:
        with open(env[var], encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise MetadataError("%s=%r: the pod's service-account token cannot be read (%s); the pod's identity "
                            "webhook mounts it" % (var, env[var], exc.strerror)) from None


def sts_url(endpoint: str, var: str) -> str:
    """An STS endpoint the pod's token may be sent to: https, or plain http on loopback (tests)."""
    url = endpoint if "://" in endpoint else "https://" + endpoint
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise MetadataError("%s=%r: the pod's token goes to STS over https only" % (var, endpoint))
    return url.rstrip("/")


# ---------------------------------------------------------------------------- object store

def object_url(endpoint: str, bucket: str, key: str, style: str = "virtual") -> str:
    """https://<bucket>.<endpoint host>/<key> (virtual-hosted) or <endpoint>/<bucket>/<key> (path)."""
    parts = urllib.parse.urlsplit(endpoint)
    quoted = urllib.parse.quote(key, safe="/~")
    if style == "path":
        return "%s://%s/%s/%s" % (parts.scheme, parts.netloc, bucket, quoted)
    return "%s://%s.%s/%s" % (parts.scheme, bucket, parts.netloc, quoted)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign_v4(method: str, url: str, region: str, creds: Credentials, now: dt.datetime, service: str = "s3",
            body: bytes = b"", extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """AWS Signature Version 4 headers (S3 and the S3 APIs of COS and OSS; ECR's JSON API)."""
    parts = urllib.parse.urlsplit(url)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": parts.netloc, "x-amz-date": stamp, **{k.lower(): v for k, v in (extra or {}).items()}}
    if service == "s3":
        headers["x-amz-content-sha256"] = payload
    if creds.token:
        headers["x-amz-security-token"] = creds.token
    names = sorted(headers)
    query = "&".join(sorted(urllib.parse.quote(k, safe="-_.~") + "=" + urllib.parse.quote(v, safe="-_.~")
                            for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)))
    canonical = "\n".join([method, parts.path or "/", query, "".join("%s:%s\n" % (n, headers[n]) for n in names),
                           ";".join(names), payload])
    scope = "%s/%s/%s/aws4_request" % (day, region, service)
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + creds.secret_key).encode(), day), region), service), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = ("AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s"
                                % (creds.access_key, scope, ";".join(names), signature))
    return headers


def signed_get(cloud: str, endpoint: str, region: str, bucket: str, key: str, creds: Credentials,
               style: str = "virtual", timeout: float = 30.0) -> bytes:
    url = object_url(endpoint, bucket, key, style)
    now = dt.datetime.now(dt.timezone.utc)
    headers = cloud_node(cloud).sign_object_get(url, bucket, region, creds, now)
    headers.pop("host", None)
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
        return bytes(resp.read())


# ---------------------------------------------------------------------------- node bundle

def read_env(path: str) -> Dict[str, str]:
    """KEY=value lines (the node's /etc/gpu-training/node.env)."""
    out: Dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, _, v = line.partition("=")
                out[k] = v
    return out


def unpack(archive: bytes, dest: str) -> List[str]:
    """Extract a gzip tar into `dest`, refusing absolute paths, `..` and links."""
    written = []
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            name = member.name.lstrip("./")
            if member.name.startswith("/") or ".." in name.split("/") or not (member.isfile() or member.isdir()):
                raise ValueError("bundle member %r is not a plain relative path" % member.name)
            target = os.path.join(dest, name)
            if member.isdir():
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            tmp = target + ".gts-new"
            with open(tmp, "wb") as out:
                out.write(src.read())
            os.chmod(tmp, member.mode & 0o777)
            os.replace(tmp, target)
            written.append(target)
    return written


def fetch_bundle(env: Dict[str, str], dest: str, metadata_url: Optional[str] = None,
                 sleep: Callable[[float], None] = time.sleep, attempts: int = 20) -> List[str]:
    """Download the node bundle named in node.env with the instance role, check its sha256,
    unpack it. Retries while the role, the network or the bucket are not there yet."""
    cloud, url, want = env["GTS_CLOUD"], env["GTS_BUNDLE_URL"], env["GTS_BUNDLE_SHA256"]
    stamp = os.path.join(dest, "var/lib/gpu-training/bundle.sha256")
    if os.path.exists(stamp) and open(stamp, encoding="utf-8").read().strip() == want:
        return []  # a reboot: this bundle is unpacked already
    parsed = urllib.parse.urlsplit(url)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    meta = Metadata(cloud, metadata_url or env.get("GTS_METADATA_URL") or None)
    last = ""
    for attempt in range(1, attempts + 1):
        try:
            creds = meta.credentials()
            body = signed_get(cloud, env["STORAGE_ENDPOINT_URL"], env["STORAGE_REGION"], bucket, key, creds,
                              env.get("STORAGE_ADDRESSING_STYLE", "virtual"))
            got = hashlib.sha256(body).hexdigest()
            if got != want:
                raise ValueError("%s has sha256 %s, the user data pins %s" % (url, got, want))
            written = unpack(base64.b64decode(body), dest)
            os.makedirs(os.path.dirname(stamp), exist_ok=True)
            with open(stamp, "w", encoding="utf-8") as fh:
                fh.write(want + "\n")
            return written
        except (OSError, MetadataError, ValueError, tarfile.TarError) as exc:
            last = str(exc)
            print("gts-fetch: attempt %d/%d: %s" % (attempt, attempts, last), file=sys.stderr, flush=True)
            if attempt < attempts:
                sleep(min(60.0, 2.0 * attempt))
    raise SystemExit("gts-fetch: could not fetch %s: %s" % (url, last))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="cloud instance metadata, role credentials and the node bundle")
    sub = parser.add_subparsers(dest="command", required=True)
    creds = sub.add_parser("credentials", help="print the instance role's credential expiry (checks the path)")
    creds.add_argument("--cloud", choices=known_clouds(), required=True)
    creds.add_argument("--metadata-url")
    fetch = sub.add_parser("fetch-bundle", help="download, verify and unpack the node scripts")
    fetch.add_argument("--env", default="/etc/gpu-training/node.env")
    fetch.add_argument("--dest", default="/")
    fetch.add_argument("--metadata-url")
    fetch.add_argument("--attempts", type=int, default=20, help="downloads to try (with back-off) before giving up")
    args = parser.parse_args(argv)
    if args.command == "credentials":
        found = Metadata(args.cloud, args.metadata_url).credentials()
        print("%s role credentials valid until %s" % (args.cloud, dt.datetime.fromtimestamp(found.expires, dt.timezone.utc)))
        return 0
    for path in fetch_bundle(read_env(args.env), args.dest, args.metadata_url, attempts=args.attempts):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
