"""Each cloud's instance metadata service, the instance role's credentials, and signed reads
from the cloud's object store — with the Python standard library only.

The user data carries this module (nothing else of the node's code): GPU hosts have python3 but
no cloud SDK, and `python3 cloudmeta.py fetch-bundle` downloads the node scripts from the
stack's bucket. The spot watcher (the reclaim notice paths), the registry login (an ECR token)
and the trainer (training/credentials.py, training/storage.py: refreshing botocore credentials
for s3://, oss:// and cosn://) use it too. Keep it small: every byte is in every node's user data.

    python3 cloudmeta.py credentials --cloud tencentcloud        # print the role's credentials' expiry
    python3 cloudmeta.py fetch-bundle --env /etc/gpu-training/node.env --dest /
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import hmac
import io
import json
import os
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

BEIJING = dt.timezone(dt.timedelta(hours=8))


@dataclass(frozen=True)
class CloudMetadata:
    """Where one cloud's metadata service answers, as each cloud documents it."""

    base_url: str
    spot_path: str  # reclaim notice; 404 while there is none
    credentials_path: str  # + role name -> the role's temporary credentials
    token_ttl_header: Optional[str] = None  # PUT /latest/api/token with this header (IMDSv2, hardened mode)
    token_header: Optional[str] = None  # then send the token in this one


CLOUDS: Dict[str, CloudMetadata] = {
    # IMDSv2: docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html,
    # spot-instance-termination-notices.html, iam-roles-for-amazon-ec2.html
    "aws": CloudMetadata("http://169.254.169.254", "/latest/meta-data/spot/instance-action",
                         "/latest/meta-data/iam/security-credentials/",
                         "X-aws-ec2-metadata-token-ttl-seconds", "X-aws-ec2-metadata-token"),
    # Hardened mode and RAM role credentials: aliyun/credentials-python provider/ecs_ram_role.py;
    # alibabacloud.com/help/en/ecs/user-guide/obtain-a-temporary-authorization-token
    "alicloud": CloudMetadata("http://100.100.100.200", "/latest/meta-data/instance/spot/termination-time",
                              "/latest/meta-data/ram/security-credentials/",
                              "X-aliyun-ecs-metadata-token-ttl-seconds", "X-aliyun-ecs-metadata-token"),
    # CAM role credentials: tencentcloud-sdk-go common/cvm_role_provider.go; cloud.tencent.com/document/product/213/4934
    "tencentcloud": CloudMetadata("http://metadata.tencentyun.com", "/latest/meta-data/spot/termination-time",
                                  "/latest/meta-data/cam/security-credentials/"),
}


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
        if cloud not in CLOUDS:
            raise ValueError("unknown cloud %r: use one of %s" % (cloud, ", ".join(sorted(CLOUDS))))
        self.cloud = cloud
        self.meta = CLOUDS[cloud]
        self.base = (base_url or self.meta.base_url).rstrip("/")
        self.timeout = timeout
        self._token: Optional[str] = None

    def _new_token(self) -> str:
        assert self.meta.token_ttl_header
        req = urllib.request.Request(self.base + "/latest/api/token", method="PUT",
                                     headers={self.meta.token_ttl_header: "21600"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return str(resp.read().decode().strip())

    def get(self, path: str, missing_ok: bool = False) -> Optional[str]:
        """The body at `path`; None for a 404 when `missing_ok`."""
        for attempt in (1, 2):
            headers = {}
            if self.meta.token_header:
                if self._token is None:
                    self._token = self._new_token()
                headers[self.meta.token_header] = self._token
            req = urllib.request.Request(self.base + path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return str(resp.read().decode().strip())
            except urllib.error.HTTPError as err:
                if err.code == 404 and missing_ok:
                    return None
                if err.code in (401, 403) and self.meta.token_header and attempt == 1:
                    self._token = None  # expired or revoked: one fresh token, then give up
                    continue
                raise MetadataError("%s metadata %s%s answered HTTP %d" % (self.cloud, self.base, path, err.code))
        raise MetadataError("%s metadata %s%s refused the token" % (self.cloud, self.base, path))

    def role_name(self) -> str:
        listing = self.get(self.meta.credentials_path) or ""
        names = [line.strip().rstrip("/") for line in listing.splitlines() if line.strip()]
        if not names:
            raise MetadataError("%s metadata %s%s lists no role: is an instance role attached?"
                                % (self.cloud, self.base, self.meta.credentials_path))
        return names[0]

    def credentials(self, role: Optional[str] = None) -> Credentials:
        path = self.meta.credentials_path + (role or self.role_name())
        body = self.get(path) or ""
        try:
            return parse_credentials(self.cloud, json.loads(body))
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataError("%s metadata %s%s did not return role credentials in the documented format: %s"
                                % (self.cloud, self.base, path, exc)) from None


def utc_seconds(stamp: str) -> float:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


def parse_credentials(cloud: str, doc: Dict[str, object]) -> Credentials:
    """A role-credentials document in the cloud's format (raises KeyError / ValueError)."""
    if cloud == "aws":  # {"Code": "Success", "AccessKeyId", "SecretAccessKey", "Token", "Expiration": "...Z"}
        if doc.get("Code", "Success") != "Success":
            raise ValueError("Code is %r" % doc.get("Code"))
        return Credentials(str(doc["AccessKeyId"]), str(doc["SecretAccessKey"]), str(doc["Token"]),
                           utc_seconds(str(doc["Expiration"])))
    if cloud == "alicloud":  # {"Code", "AccessKeyId", "AccessKeySecret", "SecurityToken", "Expiration": "...Z"}
        if doc.get("Code") != "Success":
            raise ValueError("Code is %r" % doc.get("Code"))
        return Credentials(str(doc["AccessKeyId"]), str(doc["AccessKeySecret"]), str(doc["SecurityToken"]),
                           utc_seconds(str(doc["Expiration"])))
    # tencentcloud: {"Code", "TmpSecretId", "TmpSecretKey", "Token", "ExpiredTime": unix seconds}
    if doc.get("Code") != "Success":
        raise ValueError("Code is %r" % doc.get("Code"))
    return Credentials(str(doc["TmpSecretId"]), str(doc["TmpSecretKey"]), str(doc["Token"]),
                       float(doc["ExpiredTime"]))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- pod identities

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


def sign_v2(method: str, url: str, bucket: str, creds: Credentials, now: dt.datetime) -> Dict[str, str]:
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
    to_sign = "%s\n\n\n%s\n%s%s" % (method, date, amz, resource)
    digest = hmac.new(creds.secret_key.encode(), to_sign.encode(), hashlib.sha1).digest()
    headers["Authorization"] = "AWS %s:%s" % (creds.access_key, base64.b64encode(digest).decode())
    return headers


def signed_get(cloud: str, endpoint: str, region: str, bucket: str, key: str, creds: Credentials,
               style: str = "virtual", timeout: float = 30.0) -> bytes:
    url = object_url(endpoint, bucket, key, style)
    now = dt.datetime.now(dt.timezone.utc)
    headers = sign_v2("GET", url, bucket, creds, now) if cloud == "alicloud" else sign_v4("GET", url, region, creds, now)
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
    creds.add_argument("--cloud", choices=sorted(CLOUDS), required=True)
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
