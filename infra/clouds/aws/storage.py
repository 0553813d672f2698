"""AWS object storage: one bucket for datasets and checkpoints, versioned, SSE-KMS, lifecycle,
public access blocked, TLS only."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.buckets import CHECKPOINT_PREFIX, Bucket
from infra.model.spec import Storage
from infra.render.bundle import Bundle



@dataclass
class AwsStorageArgs:
    storage: Storage
    bucket: Bucket
    bundle: Bundle  # the node scripts, fetched by each node's user data
    tags: dict[str, str]


class AwsStorage(pulumi.ComponentResource):
    bucket: aws.s3.Bucket
    key: aws.kms.Key

    def __init__(self, name: str, args: AwsStorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Storage", name, None, opts)
        s, tags = args.storage, args.tags
        child = pulumi.ResourceOptions(parent=self)
        self.name = args.bucket.name

        self.key = aws.kms.Key(f"{name}-kms", description=f"{self.name}: checkpoints and datasets",
                               enable_key_rotation=True, deletion_window_in_days=30, tags=tags, opts=child)
        self.bucket = aws.s3.Bucket(f"{name}-bucket", bucket=self.name, force_destroy=False, tags=tags,
                                    opts=child)
        on_bucket = pulumi.ResourceOptions(parent=self.bucket)
        aws.s3.BucketOwnershipControls(f"{name}-ownership", bucket=self.bucket.id,
                                       rule={"object_ownership": "BucketOwnerEnforced"}, opts=on_bucket)
        aws.s3.BucketPublicAccessBlock(f"{name}-public-access", bucket=self.bucket.id, block_public_acls=True,
                                       block_public_policy=True, ignore_public_acls=True,
                                       restrict_public_buckets=True, opts=on_bucket)
        aws.s3.BucketVersioning(f"{name}-versioning", bucket=self.bucket.id,
                                versioning_configuration={"status": "Enabled"}, opts=on_bucket)
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-sse", bucket=self.bucket.id,
            rules=[{"apply_server_side_encryption_by_default": {"sse_algorithm": "aws:kms",
                                                                "kms_master_key_id": self.key.arn},
                    "bucket_key_enabled": True}], opts=on_bucket)
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-lifecycle", bucket=self.bucket.id,
            rules=[
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="checkpoints-to-glacier-ir", status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=CHECKPOINT_PREFIX),
                    transitions=[aws.s3.BucketLifecycleConfigurationRuleTransitionArgs(
                        days=s.checkpoint_archive_days, storage_class="GLACIER_IR")]),
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="expire-noncurrent", status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(),
                    noncurrent_version_expiration=(
                        aws.s3.BucketLifecycleConfigurationRuleNoncurrentVersionExpirationArgs(
                            noncurrent_days=s.noncurrent_expire_days))),
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="abort-multipart", status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(),
                    abort_incomplete_multipart_upload=(
                        aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                            days_after_initiation=s.abort_multipart_days))),
            ], opts=on_bucket)
        aws.s3.BucketPolicy(f"{name}-tls-only", bucket=self.bucket.id,
                            policy=self.bucket.arn.apply(_tls_only_policy), opts=on_bucket)
        # Content-addressed: a changed bundle is a new key, so nodes of an older launch template
        # keep fetching the version their user data pins.
        self.bundle_object = aws.s3.BucketObject(f"{name}-node-bundle", bucket=self.bucket.id, key=args.bundle.key,
                                                 content=args.bundle.content, content_type="text/plain", tags=tags,
                                                 opts=pulumi.ResourceOptions(parent=self.bucket))
        self.register_outputs({"bucket": self.bucket.bucket, "kmsKeyArn": self.key.arn})

    def put_text(self, name: str, key: str, content: pulumi.Input[str], tags: dict[str, str]) -> pulumi.Resource:
        """A small text object in the stack's bucket (e.g. a group's current trainer image)."""
        return aws.s3.BucketObject(name, bucket=self.bucket.id, key=key, content=content, content_type="text/plain",
                                   tags=tags, opts=pulumi.ResourceOptions(parent=self.bucket))


def _tls_only_policy(arn: str) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Sid": "DenyInsecureTransport", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
        "Resource": [arn, f"{arn}/*"], "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]})
