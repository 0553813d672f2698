"""Object storage through fsspec: s3:// (AWS or any S3-compatible endpoint), oss:// (Alibaba
OSS) and cosn:// (Tencent COS), with local paths and file:// as the embedded default.

OSS and COS go through their S3-compatible endpoints with s3fs (virtual-hosted addressing,
checksums only when required), which is how most tooling reaches them; set
STORAGE_ENDPOINT_URL to point any scheme at another endpoint (a test server, a VPC endpoint).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlparse

import fsspec

from training import cloudmeta, contract, credentials

ENDPOINTS = {  # scheme -> S3-compatible endpoint template ({region} from STORAGE_REGION)
    "oss": "https://s3.oss-{region}.aliyuncs.com",
    "cosn": "https://cos.{region}.myqcloud.com",
}


# Answers of an S3-compatible store that no retry can change: the URL or the credentials are wrong.
PERMANENT = frozenset({"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                       "AllAccessDisabled", "AccountProblem", "InvalidBucketName", "InvalidAccessKeyID",
                       "AccessForbidden", "UserDisable"})


def store_answer(exc: BaseException) -> tuple[str, str] | None:
    """(code, message) of the store's answer inside `exc` (s3fs turns botocore's ClientErrors
    into OSErrors caused by them), or None when the store never answered (a timeout, a dropped
    connection)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        error = getattr(current, "response", None)
        if isinstance(error, dict) and error.get("Error", {}).get("Code"):
            code = str(error["Error"]["Code"])
            return code, str(error["Error"].get("Message", "") or code)
        current = current.__cause__ or current.__context__
    return None


def permanent_cause(exc: BaseException) -> str | None:
    """`Code: message` when `exc` (or what it wraps) is an answer no retry changes, else None
    (a timeout, a 5xx, a dropped connection)."""
    answer = store_answer(exc)
    if answer is not None and answer[0] in PERMANENT:
        return f"{answer[0]}: {answer[1]}"
    return None


class StorageRefused(Exception):
    """The store answered with a permanent error (the message names the URL and the cause)."""


class StorageUnavailable(Exception):
    """The store did not answer (a 5xx, a timeout, a dropped connection) after the retries: not a
    fault of the checkpoint, so never a reason to skip its step (the message names the URL)."""


class Location:
    """A checkpoint root: a filesystem and a path on it (no scheme). An object store's filesystem
    (s3fs, with its client) is made at its first use, not here: a training process whose fetch
    process already took the lease and listed the bucket (training/ckpt/fetch_process.py) opens
    its own store only for its first upload or lease renewal, after the resume (issue 44)."""

    def __init__(self, fs: Any, root: str, url: str, make: Callable[[], Any] | None = None):
        """`fs`, or None and `make`: what makes an object store's filesystem at its first use."""
        self._fs, self._make = fs, make
        self.root, self.url = root, url
        self.remote = make is not None or fs.protocol not in ("file", ("file", "local"), "local")
        self._lock = threading.Lock()

    @property
    def fs(self) -> Any:  # fsspec.AbstractFileSystem
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    assert self._make is not None
                    self._fs = self._make()
        return self._fs

    @property
    def opened(self) -> bool:
        """Whether the filesystem has been made (its libraries imported, its client set up)."""
        return self._fs is not None

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *[p.strip("/") for p in parts]])


def _s3_options(scheme: str, env: Mapping[str, str]) -> dict[str, Any]:
    endpoint = env.get("STORAGE_ENDPOINT_URL")
    region = env.get("STORAGE_REGION", "")
    if endpoint is None and scheme in ENDPOINTS:
        if not region:
            raise ValueError(f"{scheme}:// needs STORAGE_REGION (e.g. cn-hangzhou / ap-guangzhou) "
                             "or STORAGE_ENDPOINT_URL")
        endpoint = ENDPOINTS[scheme].format(region=region)
    style = env.get("STORAGE_ADDRESSING_STYLE", "path" if endpoint and "127.0.0.1" in endpoint else "virtual")
    config: dict[str, Any] = {"s3": {"addressing_style": style},
                              "request_checksum_calculation": "when_required",
                              "response_checksum_validation": "when_required",
                              "retries": {"max_attempts": 2, "mode": "standard"},
                              "connect_timeout": 5, "read_timeout": 30}
    if scheme == "oss":
        config["signature_version"] = "s3"
    options: dict[str, Any] = {"config_kwargs": config}
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    if region:
        options.setdefault("client_kwargs", {})["region_name"] = region
    return options


class RoleCredentials:
    """An aiobotocore credential provider over training/cloudmeta.py: the ECS RAM / CVM CAM role
    from the metadata service, or ACK's RRSA role. botocore refreshes them before they expire
    (15 minutes ahead, then 10: RefreshableCredentials' advisory and mandatory windows)."""

    METHOD = "gts-role"
    CANONICAL_NAME = "GtsRole"

    def __init__(self, fetch: Callable[[], cloudmeta.Credentials]):
        self.fetch = fetch

    async def _metadata(self) -> dict[str, str]:
        creds = await asyncio.to_thread(self.fetch)
        expiry = datetime.fromtimestamp(creds.expires, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"access_key": creds.access_key, "secret_key": creds.secret_key, "token": creds.token,
                "expiry_time": expiry}

    async def load(self) -> Any:
        from aiobotocore.credentials import AioRefreshableCredentials

        return AioRefreshableCredentials.create_from_metadata(await self._metadata(), refresh_using=self._metadata,
                                                              method=self.METHOD)


def _session(env: Mapping[str, str]) -> Callable[[], Any] | None:
    """A maker of the aiobotocore session that signs with the role STORAGE_CREDENTIALS names, or
    None for the SDK's own chain (AWS: instance role, EKS Pod Identity, environment). The setting
    is checked now; the session (aiobotocore's import) is made when the store is first used."""
    source = env.get(contract.STORAGE_CREDENTIALS.name, "default") or "default"
    if source == "default":
        return None
    fetch = credentials.credential_source(source, env)

    def make() -> Any:
        from aiobotocore.session import AioSession

        session = AioSession()
        resolver = session.get_component("credential_provider")
        resolver.insert_before("env", RoleCredentials(fetch))
        return session
    return make


def location(url: str, env: Mapping[str, str] | None = None, keys: tuple[str, str] | None = None) -> Location:
    """The filesystem and root for a checkpoint or dataset URL. `env` holds the STORAGE_*
    settings (default: this process's environment); `keys` an access key pair to sign with
    instead of a role (an operator's own, e.g. `make dataset`)."""
    env = os.environ if env is None else env
    parsed = urlparse(url)
    scheme = parsed.scheme or "file"
    if scheme == "file":
        # auto_mkdir: a put into a folder that does not exist yet creates it, as a bucket would.
        return Location(fsspec.filesystem("file", auto_mkdir=True), os.path.abspath(parsed.path if parsed.scheme else url),
                        url)
    if scheme not in ("s3", "oss", "cosn"):
        raise ValueError(f"unsupported storage URL {url!r}: use s3://, oss://, cosn://, file:// or a path")
    if importlib.util.find_spec("s3fs") is None:  # (found, not imported: the store is opened at its first use)
        raise ValueError(f"{url}: s3fs is not installed; install the trainer's requirements (training/requirements.txt)")
    options = _s3_options(scheme, env)  # (a setting that is wrong or missing is said now, not at the first use)
    if keys is not None:
        options.update(key=keys[0], secret=keys[1])
    session = _session(env) if keys is None else None

    def make() -> Any:
        return fsspec.filesystem("s3", skip_instance_cache=True, **options, **({"session": session()} if session else {}))

    return Location(None, f"{parsed.netloc}{parsed.path}".rstrip("/"), url, make=make)
