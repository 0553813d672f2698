"""Object storage through fsspec: s3:// (AWS or any S3-compatible endpoint), oss:// (Alibaba
OSS) and cosn:// (Tencent COS), with local paths and file:// as the embedded default.

OSS and COS go through their S3-compatible endpoints with s3fs (virtual-hosted addressing,
checksums only when required), which is how most tooling reaches them; set
STORAGE_ENDPOINT_URL to point any scheme at another endpoint (a test server, a VPC endpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import fsspec

ENDPOINTS = {  # scheme -> S3-compatible endpoint template ({region} from STORAGE_REGION)
    "oss": "https://s3.oss-{region}.aliyuncs.com",
    "cosn": "https://cos.{region}.myqcloud.com",
}


@dataclass(frozen=True)
class Location:
    """A checkpoint root: a filesystem and a path on it (no scheme)."""

    fs: Any  # fsspec.AbstractFileSystem
    root: str
    url: str

    @property
    def remote(self) -> bool:
        return self.fs.protocol not in ("file", ("file", "local"), "local")

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *[p.strip("/") for p in parts]])


def _s3_options(scheme: str) -> dict[str, Any]:
    endpoint = os.environ.get("STORAGE_ENDPOINT_URL")
    region = os.environ.get("STORAGE_REGION", "")
    if endpoint is None and scheme in ENDPOINTS:
        if not region:
            raise ValueError(f"{scheme}:// needs STORAGE_REGION (e.g. cn-hangzhou / ap-guangzhou) "
                             "or STORAGE_ENDPOINT_URL")
        endpoint = ENDPOINTS[scheme].format(region=region)
    style = os.environ.get("STORAGE_ADDRESSING_STYLE", "path" if endpoint and "127.0.0.1" in endpoint else "virtual")
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


def location(url: str) -> Location:
    """The filesystem and root for a checkpoint or dataset URL."""
    parsed = urlparse(url)
    scheme = parsed.scheme or "file"
    if scheme == "file":
        return Location(fsspec.filesystem("file"), os.path.abspath(parsed.path if parsed.scheme else url), url)
    if scheme not in ("s3", "oss", "cosn"):
        raise ValueError(f"unsupported storage URL {url!r}: use s3://, oss://, cosn://, file:// or a path")
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **_s3_options(scheme))
    return Location(fs, f"{parsed.netloc}{parsed.path}".rstrip("/"), url)
