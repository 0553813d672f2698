"""Alibaba Cloud OSS: one bucket for datasets and checkpoints, versioned, KMS-encrypted,
zone-redundant, lifecycle to Archive, private ACL and a public access block."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.buckets import CHECKPOINT_PREFIX, Bucket
from infra.model.spec import Storage
from infra.render.bundle import Bundle



@dataclass
class AlicloudStorageArgs:
    storage: Storage
    bucket: Bucket
    bundle: Bundle  # the node scripts, fetched by each node's user data
    tags: dict[str, str]


class AlicloudStorage(pulumi.ComponentResource):
    bucket: alicloud.oss.Bucket

    def __init__(self, name: str, args: AlicloudStorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Storage", name, None, opts)
        s = args.storage
        self.name = args.bucket.name
        rules = alicloud.oss
        self.bucket = alicloud.oss.Bucket(
            f"{name}-bucket", bucket=self.name, storage_class="Standard", redundancy_type="ZRS", force_destroy=False,
            versioning=rules.BucketVersioningArgs(status="Enabled"),
            server_side_encryption_rule=rules.BucketServerSideEncryptionRuleArgs(sse_algorithm="KMS"),
            lifecycle_rules=[
                rules.BucketLifecycleRuleArgs(
                    id="checkpoints-to-archive", enabled=True, prefix=CHECKPOINT_PREFIX,
                    # Archive, not ColdArchive: the bucket is zone-redundant (a zone outage loses no
                    # checkpoint), and ZRS covers Standard, IA and Archive only — ColdArchive objects
                    # would silently become single-zone (OSS "Storage redundancy"; "Cold Archive and
                    # Deep Cold Archive objects are still stored as LRS objects").
                    transitions=[rules.BucketLifecycleRuleTransitionArgs(days=s.checkpoint_archive_days,
                                                                         storage_class="Archive")]),
                rules.BucketLifecycleRuleArgs(
                    id="expire-noncurrent", enabled=True, prefix="",
                    noncurrent_version_expirations=[rules.BucketLifecycleRuleNoncurrentVersionExpirationArgs(
                        days=s.noncurrent_expire_days)]),
                rules.BucketLifecycleRuleArgs(
                    id="abort-multipart", enabled=True, prefix="",
                    abort_multipart_uploads=[rules.BucketLifecycleRuleAbortMultipartUploadArgs(
                        days=s.abort_multipart_days)]),
            ],
            tags=args.tags, opts=pulumi.ResourceOptions(parent=self))
        on_bucket = pulumi.ResourceOptions(parent=self.bucket)
        alicloud.oss.BucketAcl(f"{name}-acl", bucket=self.bucket.bucket, acl="private", opts=on_bucket)
        alicloud.oss.BucketPublicAccessBlock(f"{name}-public-access", bucket=self.bucket.bucket,
                                             block_public_access=True, opts=on_bucket)
        # Content-addressed: a changed bundle is a new key, so nodes of an older launch template
        # keep fetching the version their user data pins.
        self.bundle_object = alicloud.oss.BucketObject(f"{name}-node-bundle", bucket=self.bucket.bucket,
                                                       key=args.bundle.key, content=args.bundle.content,
                                                       content_type="text/plain",
                                                       opts=pulumi.ResourceOptions(parent=self.bucket))
        self.register_outputs({"bucket": self.bucket.bucket})

    def put_text(self, name: str, key: str, content: pulumi.Input[str], tags: dict[str, str]) -> pulumi.Resource:
        """A small text object in the stack's bucket (e.g. a group's current trainer image)."""
        return alicloud.oss.BucketObject(name, bucket=self.bucket.bucket, key=key, content=content,
                                         content_type="text/plain", opts=pulumi.ResourceOptions(parent=self.bucket))
