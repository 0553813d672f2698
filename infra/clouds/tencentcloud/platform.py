"""The Tencent Cloud side of a stack."""

from __future__ import annotations

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.clouds.base import CloudPlatform


class TencentcloudPlatform(CloudPlatform):
    CLOUD = "tencentcloud"

    def make_provider(self, region: str) -> pulumi.ProviderResource:
        return tencentcloud.Provider(f"{self.name}-{region}", region=region,
                                     opts=pulumi.ResourceOptions(parent=self))
