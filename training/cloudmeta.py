"""The instance metadata service, the instance role's credentials, and signed reads from the
object store — generic, with the Python standard library only. What is one cloud's comes from its
modules, found by name (`cloud_metadata`, `cloud_node`; the interfaces: `CloudMetadata`,
`CloudNode`): infra/clouds/<cloud>/metadata.py and node.py.

The user data carries this module and the node's own cloud's metadata.py (nothing else of the
node's code): GPU hosts have python3 but no cloud SDK, and `python3 cloudmeta.py fetch-bundle`
downloads the node scripts from the stack's bucket. The spot watcher, the registry login, the GPU health
watch and the trainer (training/credentials.py, training/ckpt/storage.py: refreshing botocore
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
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, cast


if TYPE_CHECKING:  # the interface each cloud answers; typing-only (the user data carries no typing code)
    from typing import Mapping, Protocol, Tuple

    class CloudMetadata(Protocol):
        """infra/clouds/<cloud>/metadata.py: the cloud's metadata service and object store as the
        fetcher reads them. The user data carries the node's own (the bundle is fetched with it)."""

        NAME: str  # the cloud's key (GTS_CLOUD, --cloud)
        METADATA_URL: str  # the metadata service's base URL (the profile's metadata_url)
        CREDENTIALS_PATH: str  # + role name -> the role's temporary credentials
        ZONE_PATH: str  # the instance's zone (training/ckpt/peer/ring.py node_zone)
        TOKEN_TTL_HEADER: Optional[str]  # PUT /latest/api/token with this header first (IMDSv2, hardened mode)
        TOKEN_HEADER: Optional[str]  # then send the token in this one

        def role_credentials(self, doc: Dict[str, object]) -> Credentials:
            """The role-credentials document in the cloud's format (raises KeyError / ValueError)."""

        def sign_object_get(self, url: str, bucket: str, region: str, creds: Credentials,
                            now: dt.datetime) -> Dict[str, str]:
            """The headers of a signed GET of one object from the cloud's S3-compatible API."""

    class CloudNode(Protocol):
        """infra/clouds/<cloud>/node.py: the cloud's part of the node's tools (the spot watch, the
        registry login, the GPU health watch) and of the trainer's credentials. The bundle
        carries every cloud's; the trainer image too."""

        NAME: str
        SPOT_PATH: str  # the reclaim notice; 404 while there is none
        INSTANCE_ID_PATH: str
        REGION_PATH: str
        POD_IDENTITY: Optional[str]  # the STORAGE_CREDENTIALS source of its pods' own role (None: the SDK's chain)

        def spot_deadline(self, body: str) -> Optional[dt.datetime]:
            """When the instance goes, in UTC, from the body at SPOT_PATH (None: unreadable)."""

        def other_notice(self, meta: Metadata) -> Tuple[Optional[str], Optional[str], Optional[dt.datetime]]:
            """A notice besides the reclaim: (kind, body, when): "scale-in" (checkpoint and go) or
            "rebalance" (checkpoint now, go on); (None, None, None) when there is none."""

        def registry_login(self, meta: Metadata, region: str,
                           endpoint: Optional[str]) -> Optional[Tuple[str, str, str]]:
            """(registry, user, password) for `docker login`, or None: the registry needs no login."""

        def rendezvous_key(self, meta: Metadata, region: str, ref: str, endpoint: Optional[str] = None) -> str:
            """The group's rendezvous key from the cloud's secret store (`ref`: node.env's
            GTS_RDZV_KEY_REF, infra/clouds/<cloud>/secrets.py), read with the instance role."""

        def replace_api_url(self, region: str) -> str:
            """The endpoint of the API that replaces a node of the region's scaling groups."""

        def replace_self(self, creds: Credentials, region: str, instance: str, url: str, group: str,
                         group_id: str) -> str:
            """Ask the node's scaling group to replace this instance; the cloud's answer. Raises
            OSError / ValueError / KeyError / MetadataError (the caller retries)."""

        def group_id_problem(self, group_id: str) -> Optional[str]:
            """Why a scaling-group id given to the node is not one of this cloud's (None: fine)."""

        def pod_identity_credentials(self, env: Mapping[str, str], token: Callable[[str], str],
                                     sts_url: Callable[[str, str], str], timeout: float) -> Credentials:
            """POD_IDENTITY's exchange of the pod's service-account token for its role's
            credentials; `token(var)` reads the token from the file env[var] names, `sts_url(endpoint,
            var)` checks the STS endpoint (training/credentials.py hands both in)."""


HERE = os.path.dirname(os.path.abspath(__file__))
# Where a cloud's modules are, one folder and never a second: on a node, beside this file,
# /usr/local/lib/gts/clouds/<cloud>/<part>.py (the user data writes the node's own metadata part,
# the bundle the node parts); in a checkout and the trainer image (/opt/gts), where no clouds/
# folder is beside it, the repository's layout. A cloud missing from the one folder is unknown:
# it is never looked for anywhere else. Loaded by path: the modules import nothing, and infra/'s
# packages (pulumi) are never imported.
PLACES = ((os.path.join(HERE, "clouds"),) if os.path.isdir(os.path.join(HERE, "clouds"))
          else (os.path.join(os.path.dirname(HERE), "infra", "clouds"),))
CLOUD_NAME = re.compile(r"[a-z0-9]+")
_LOADED: Dict[str, object] = {}


class UnknownCloud(ValueError):
    """A cloud name with no module here."""


def known_clouds(part: str = "metadata") -> List[str]:
    """The clouds whose `part` module is here."""
    found = {os.path.basename(os.path.dirname(p)) for place in PLACES for p in glob.glob(os.path.join(place, "*", part + ".py"))}
    return sorted(n for n in found if CLOUD_NAME.fullmatch(n))


def _this_module() -> object:
    """This module's object (as __main__ when run as the node's fetcher, else imported): what the
    loaded modules raise and catch must be this module's classes, not another copy's."""
    me = sys.modules.get(__name__)
    if me is None or vars(me) is not globals():
        raise RuntimeError("cloudmeta: import it, or run it as a script")
    return me


def _load(name: str, part: str) -> object:
    """The cloud's `part` module, loaded once by path and handed this module as its `cloudmeta`."""
    key = name + "." + part
    if key not in _LOADED:
        paths = [os.path.join(place, name, part + ".py") for place in PLACES] if CLOUD_NAME.fullmatch(name) else []
        path = next((p for p in paths if os.path.isfile(p)), None)
        if path is None:
            raise UnknownCloud("%r is not a cloud known here (known: %s; its modules: infra/clouds/<cloud>/%s.py)"
                               % (name, ", ".join(known_clouds(part)), part))
        spec = importlib.util.spec_from_file_location("gts_clouds_%s_%s" % (name, part), path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        setattr(module, "cloudmeta", _this_module())  # its generic primitives, without an import
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        _LOADED[key] = module
    return _LOADED[key]


def cloud_metadata(name: str) -> CloudMetadata:
    """The cloud's metadata module (UnknownCloud for a name that has none here)."""
    return cast("CloudMetadata", _load(name, "metadata"))


def cloud_node(name: str) -> CloudNode:
    """The cloud's node module (UnknownCloud for a name that has none here)."""
    return cast("CloudNode", _load(name, "node"))


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
        self.cloud_meta = cloud_metadata(cloud)
        self.base = (base_url or self.cloud_meta.METADATA_URL).rstrip("/")
        self.timeout = timeout
        self._token: Optional[str] = None

    def _new_token(self) -> str:
        assert self.cloud_meta.TOKEN_TTL_HEADER
        req = urllib.request.Request(self.base + "/latest/api/token", method="PUT",
                                     headers={self.cloud_meta.TOKEN_TTL_HEADER: "21600"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return str(resp.read().decode().strip())

    def get(self, path: str, missing_ok: bool = False) -> Optional[str]:
        """The body at `path`; None for a 404 when `missing_ok`."""
        for attempt in (1, 2):
            headers = {}
            if self.cloud_meta.TOKEN_HEADER:
                if self._token is None:
                    self._token = self._new_token()
                headers[self.cloud_meta.TOKEN_HEADER] = self._token
            req = urllib.request.Request(self.base + path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return str(resp.read().decode().strip())
            except urllib.error.HTTPError as err:
                if err.code == 404 and missing_ok:
                    return None
                if err.code in (401, 403) and self.cloud_meta.TOKEN_HEADER and attempt == 1:
                    self._token = None  # expired or revoked: one fresh token, then give up
                    continue
                raise MetadataError("%s metadata %s%s answered HTTP %d" % (self.cloud, self.base, path, err.code))
        raise MetadataError("%s metadata %s%s refused the token" % (self.cloud, self.base, path))

    def role_name(self) -> str:
        listing = self.get(self.cloud_meta.CREDENTIALS_PATH) or ""
        names = [line.strip().rstrip("/") for line in listing.splitlines() if line.strip()]
        if not names:
            raise MetadataError("%s metadata %s%s lists no role: is an instance role attached?"
                                % (self.cloud, self.base, self.cloud_meta.CREDENTIALS_PATH))
        return names[0]

    def credentials(self, role: Optional[str] = None) -> Credentials:
        path = self.cloud_meta.CREDENTIALS_PATH + (role or self.role_name())
        body = self.get(path) or ""
        try:
            return self.cloud_meta.role_credentials(json.loads(body))
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataError("%s metadata %s%s did not return role credentials in the documented format: %s"
                                % (self.cloud, self.base, path, exc)) from None


def utc_seconds(stamp: str) -> float:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


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
    headers = cloud_metadata(cloud).sign_object_get(url, bucket, region, creds, now)
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
