"""Where a stack keeps its objects: one bucket per cloud, in the cloud's default region, with
checkpoints and datasets under fixed prefixes. The storage components create the buckets
under these names; node groups, user data and the trainer read the same names from here."""

from __future__ import annotations

from dataclasses import dataclass

from infra.spec import StackSpec

# Every cloud's bucket holds checkpoints and datasets under the same prefixes; node roles are
# limited to them and lifecycle rules archive the first.
CHECKPOINT_PREFIX = "checkpoints/"
DATASET_PREFIX = "datasets/"
# The URL scheme the trainer's storage layer (training/storage.py) reads for each cloud.
SCHEMES = {"aws": "s3", "alicloud": "oss", "tencentcloud": "cosn"}


@dataclass(frozen=True)
class Bucket:
    cloud: str
    name: str
    region: str

    @property
    def url(self) -> str:
        return f"{SCHEMES[self.cloud]}://{self.name}/"

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
    name = f"{spec.storage.bucket_prefix}-{account.region}"
    if cloud == "tencentcloud":
        name += f"-{account.app_id or ''}"
    return Bucket(cloud, name, account.region)
