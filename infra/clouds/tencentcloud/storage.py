"""Tencent Cloud COS: one bucket (`<prefix>-<region>-<APPID>`) for datasets and checkpoints,
private, versioned, encrypted, with lifecycle to ARCHIVE / DEEP_ARCHIVE."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.buckets import CHECKPOINT_PREFIX, Bucket
from infra.model.spec import Storage
from infra.render.bundle import Bundle

DEEP_ARCHIVE_AFTER_DAYS = 180


@dataclass
class TencentStorageArgs:
    storage: Storage
    bucket: Bucket
    bundle: Bundle  # the node scripts, fetched by each node's user data
    tags: dict[str, str]


class TencentStorage(pulumi.ComponentResource):
    bucket: tencentcloud.cos.Bucket

    def __init__(self, name: str, args: TencentStorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Storage", name, None, opts)
        s = args.storage
        self.name = args.bucket.name
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
        # Content-addressed: a changed bundle is a new key, so nodes of an older launch configuration
        # keep fetching the version their user data pins.
        self.bundle_object = tencentcloud.cos.BucketObject(f"{name}-node-bundle", bucket=self.bucket.bucket,
                                                           key=args.bundle.key, content=args.bundle.content,
                                                           content_type="text/plain", tags=args.tags,
                                                           opts=pulumi.ResourceOptions(parent=self.bucket))
        self.register_outputs({"bucket": self.bucket.bucket})

    def put_text(self, name: str, key: str, content: pulumi.Input[str], tags: dict[str, str]) -> pulumi.Resource:
        """A small text object in the stack's bucket (e.g. a group's current trainer image)."""
        return tencentcloud.cos.BucketObject(name, bucket=self.bucket.bucket, key=key, content=content,
                                             content_type="text/plain", tags=tags,
                                             opts=pulumi.ResourceOptions(parent=self.bucket))
