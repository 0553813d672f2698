"""The AWS side of a stack."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.clouds.base import CloudPlatform


class AwsPlatform(CloudPlatform):
    CLOUD = "aws"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        # default_tags reach resources the components forget to tag; they tag explicitly too,
        # because policies and previews see only explicit inputs.
        return aws.Provider(f"{self.name}-{region}", region=region,
                            default_tags=aws.ProviderDefaultTagsArgs(tags=self.tags),
                            opts=pulumi.ResourceOptions(parent=self))
