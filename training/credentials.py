"""Where the trainer's bucket credentials come from (STORAGE_CREDENTIALS in the contract):
`instance-role` (the VM's role from its cloud's metadata service), a cloud's pod identity (a
Kubernetes pod's own role, by its projected service-account token: the cloud's node module names
its source, `POD_IDENTITY`, and makes the exchange) or `default` (the AWS SDK chain finds the EC2
instance role and EKS Pod Identity itself). training/storage.py turns the function chosen here
into refreshing botocore credentials."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from training.cloudmeta import Credentials, Metadata, MetadataError, UnknownCloud, cloud_node, known_clouds
from training.contract import CREDENTIAL_SOURCES


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
    cloud = pod_identity(source) if source in CREDENTIAL_SOURCES else None
    if cloud is None:
        raise ValueError(f"STORAGE_CREDENTIALS={source!r}: use one of {', '.join(CREDENTIAL_SOURCES)}")
    exchange = cloud_node(cloud).pod_identity_credentials
    return lambda: exchange(env, 10.0)
