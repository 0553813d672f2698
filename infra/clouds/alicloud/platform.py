"""The Alibaba Cloud side of a stack."""

from __future__ import annotations

import pulumi
import pulumi_alicloud as alicloud

from infra.clouds.base import CloudPlatform


class AlicloudPlatform(CloudPlatform):
    CLOUD = "alicloud"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        return alicloud.Provider(f"{self.name}-{region}", region=region,
                                 opts=pulumi.ResourceOptions(parent=self))
