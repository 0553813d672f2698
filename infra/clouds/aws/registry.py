"""AWS: an ECR repository for the trainer image (immutable tags, scanned on push). Nodes pull
with their role: EKS's kubelet has the ECR credential provider, VM nodes log in with
`cloudmeta.py registry-login` (an ECR token signed with the instance role)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.image import Registry


@dataclass
class AwsRegistryArgs:
    env: str
    tags: dict[str, str]


class AwsRegistry(pulumi.ComponentResource):
    repository: aws.ecr.Repository

    def __init__(self, name: str, args: AwsRegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Registry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # IMMUTABLE: a tag is the image's content (infra/image.py), never moved to other bytes.
        self.repository = aws.ecr.Repository(
            f"{name}-trainer", name=f"gpu-training-stack/{args.env}/trainer", image_tag_mutability="IMMUTABLE",
            image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
            encryption_configurations=[aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="AES256")],
            # Images are rebuilt from the repository's sources; outside prod, `pulumi destroy` may
            # delete a repository that still holds them (ECR refuses otherwise).
            force_delete=args.env != "prod", tags=args.tags, opts=child)
        token = aws.ecr.get_authorization_token_output(registry_id=self.repository.registry_id,
                                                       opts=pulumi.InvokeOutputOptions(parent=self))
        url = self.repository.repository_url
        self.registry = Registry(push_repository=url, pull_repository=url, address=token.proxy_endpoint,
                                 username=token.user_name, password=token.password)
        self.register_outputs({"repositoryUrl": url})
