"""Where the trainer's bucket credentials come from (STORAGE_CREDENTIALS in the contract):
`instance-role` (the VM's role from its cloud's metadata service), a cloud's pod identity (a
Kubernetes pod's own role, by its projected service-account token: the cloud's node module names
its source, `POD_IDENTITY`, and makes the exchange) or `default` (the AWS SDK chain finds the EC2
instance role and EKS Pod Identity itself). training/ckpt/storage.py turns the function chosen here
into refreshing botocore credentials."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping

from training.cloudmeta import Credentials, Metadata, MetadataError, UnknownCloud, cloud_node, known_clouds
from training.contract import CREDENTIAL_SOURCES


def service_account_token(env: Mapping[str, str], var: str) -> str:
    """The pod's projected service-account token, from the file `var` names (read on every call:
    Kubernetes rotates it)."""
    try:
        with open(env[var], encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise MetadataError(f"{var}={env[var]!r}: the pod's service-account token cannot be read "
                            f"({exc.strerror}); the pod's identity webhook mounts it") from None


def sts_url(endpoint: str, var: str) -> str:
    """An STS endpoint the pod's token may be sent to: https, or plain http on loopback (tests)."""
    url = endpoint if "://" in endpoint else "https://" + endpoint
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise MetadataError(f"{var}={endpoint!r}: the pod's token goes to STS over https only")
    return url.rstrip("/")


def pod_identity(source: str) -> str | None:
    """The cloud whose node module exchanges a pod's token for STORAGE_CREDENTIALS=`source`."""
    return next((c for c in known_clouds() if cloud_node(c).POD_IDENTITY == source), None)


def credential_source(source: str, env: Mapping[str, str]) -> Callable[[], Credentials]:
    """The function that gives fresh credentials for STORAGE_CREDENTIALS=`source` (not `default`:
    botocore's own chain serves that)."""
    if source == "instance-role":
        cloud = env.get("GTS_CLOUD", "")
        try:
            return Metadata(cloud, env.get("GTS_METADATA_URL") or None).credentials
        except UnknownCloud as exc:
            raise MetadataError(f"instance-role credentials need GTS_CLOUD: {exc}") from None
    owner = pod_identity(source) if source in CREDENTIAL_SOURCES else None
    if owner is None:
        raise ValueError(f"STORAGE_CREDENTIALS={source!r}: use one of {', '.join(CREDENTIAL_SOURCES)}")
    exchange = cloud_node(owner).pod_identity_credentials
    return lambda: exchange(env, lambda var: service_account_token(env, var), sts_url, 10.0)
