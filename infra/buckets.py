"""Where a stack keeps its objects: one bucket per cloud, in the cloud's default region, with
checkpoints and datasets under fixed prefixes. The storage components create the buckets
under these names; node groups, user data and the trainer read the same names from here."""

from __future__ import annotations

from dataclasses import dataclass

from infra.clouds import profile, profiles
from infra.model.spec import StackSpec

# Every cloud's bucket holds checkpoints and datasets under the same prefixes; node roles are
# limited to them and lifecycle rules archive the first.
CHECKPOINT_PREFIX = "checkpoints/"
DATASET_PREFIX = "datasets/"
# The URL scheme the trainer's storage layer (training/ckpt/storage.py) reads for each cloud.
SCHEMES = {p.name: p.storage_scheme for p in profiles()}


@dataclass(frozen=True)
class Bucket:
    cloud: str
    name: str
    region: str

    @property
    def url(self) -> str:
        return f"{profile(self.cloud).storage_scheme}://{self.name}/"

    @property
    def checkpoint_root(self) -> str:
        """The root under which each node group has its own checkpoint folder."""
        return f"{self.url}{CHECKPOINT_PREFIX}"

    def checkpoint_url(self, group: str) -> str:
        return f"{self.checkpoint_root}{group}/"


def bucket(spec: StackSpec, cloud: str) -> Bucket:
    """The stack's bucket on `cloud`: `<prefix>-<region>` (COS: `-<APPID>` appended, as COS
    requires)."""
    account = spec.clouds[cloud]  # type: ignore[index]  # cloud is one of the Cloud literals
    name = profile(cloud).bucket_name(spec.storage.bucket_prefix, account.region, account.app_id)
    return Bucket(cloud, name, account.region)


NODES_PREFIX = "nodes/"  # the node bundle (scripts and units the user data fetches)


def image_key(group: str) -> str:
    """Where a VM group's current trainer image is (cloudinit/scripts/gts-image.py reads it at each
    trainer start): a node whose user data cannot change, such as a fixed instance, still gets a
    new image."""
    return f"{NODES_PREFIX}images/{group}"


def endpoint(cloud: str, bucket_region: str, node_region: str) -> str:
    """The S3-compatible endpoint a node in `node_region` reads the bucket through (each cloud's
    profile, infra/clouds/<cloud>/profile.py storage_endpoint; an unknown cloud is an error).

    AWS: the regional endpoint (a VPC's S3 gateway endpoint serves it in-region). Alibaba: the
    internal endpoint in the bucket's region, else the public one ("Internal (VPC):
    https://s3.oss-{region}-internal.aliyuncs.com", OSS "use Amazon S3 SDKs to access OSS").
    Tencent: one name, resolved to an internal address from the same region (COS "CVM accesses
    COS": same-region access is routed internally).
    """
    return profile(cloud).storage_endpoint(bucket_region, node_region)
