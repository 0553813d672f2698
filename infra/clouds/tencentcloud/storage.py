"""Tencent Cloud COS: one bucket (`<prefix>-<region>-<APPID>`) for datasets and checkpoints,
private, versioned, encrypted, with lifecycle to ARCHIVE / DEEP_ARCHIVE."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.clouds.base import CHECKPOINT_PREFIX
from infra.spec import StackSpec, Storage

DEEP_ARCHIVE_AFTER_DAYS = 180


def bucket_name(storage: Storage, region: str, app_id: str) -> str:
    return f"{storage.bucket_prefix}-{region}-{app_id}"


def checkpoint_root(spec: StackSpec) -> str:
    """Where this cloud's node groups keep checkpoints: cosn://<bucket>/{CHECKPOINT_PREFIX}."""
    account = spec.clouds["tencentcloud"]
    return f"cosn://{bucket_name(spec.storage, account.region, account.app_id or '')}/{CHECKPOINT_PREFIX}"


@dataclass
class TencentStorageArgs:
    storage: Storage
    region: str
    app_id: str
    tags: dict[str, str]


class TencentStorage(pulumi.ComponentResource):
    bucket: tencentcloud.cos.Bucket

    def __init__(self, name: str, args: TencentStorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Storage", name, None, opts)
        s = args.storage
        self.name = bucket_name(s, args.region, args.app_id)
        cos = tencentcloud.cos
        self.bucket = cos.Bucket(
            f"{name}-bucket", bucket=self.name, acl="private", versioning_enable=True,
            encryption_algorithm="AES256", force_clean=False,
            lifecycle_rules=[
                cos.BucketLifecycleRuleArgs(
                    id="checkpoints-to-archive", filter_prefix=CHECKPOINT_PREFIX,
                    transitions=[cos.BucketLifecycleRuleTransitionArgs(days=s.checkpoint_archive_days,
                                                                       storage_class="ARCHIVE"),
                                 cos.BucketLifecycleRuleTransitionArgs(
                                     days=max(DEEP_ARCHIVE_AFTER_DAYS, s.checkpoint_archive_days + 60),
                                     storage_class="DEEP_ARCHIVE")]),
                cos.BucketLifecycleRuleArgs(
                    id="expire-noncurrent", filter_prefix="",
                    non_current_expiration=cos.BucketLifecycleRuleNonCurrentExpirationArgs(
                        non_current_days=s.noncurrent_expire_days)),
                cos.BucketLifecycleRuleArgs(
                    id="abort-multipart", filter_prefix="",
                    abort_incomplete_multipart_upload=cos.BucketLifecycleRuleAbortIncompleteMultipartUploadArgs(
                        days_after_initiation=s.abort_multipart_days)),
            ],
            tags=args.tags, opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"bucket": self.bucket.bucket})
