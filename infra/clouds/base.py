"""What every cloud's platform component shares: one explicit provider per region, tags,
and the export/registration protocol. Cloud modules subclass it and add their concerns."""

from __future__ import annotations

from typing import Any

import pulumi

from infra.spec import CloudAccount, Network, NodeGroup, Peering, StackSpec
from infra.tags import stack_tags

# Every cloud's bucket holds checkpoints and datasets under the same prefixes; node roles are
# limited to them and lifecycle rules archive the first.
CHECKPOINT_PREFIX = "checkpoints/"
DATASET_PREFIX = "datasets/"


class CloudPlatform(pulumi.ComponentResource):
    """Base of `gpu-training-stack:<cloud>:Platform`.

    Subclasses set CLOUD, implement `make_provider(region)` and `build()`; `build()` fills
    `self.exports`. Providers are created here, one per region the spec uses, and passed to
    children explicitly (the stack files disable default providers).
    """

    CLOUD = ""

    def __init__(self, name: str, spec: StackSpec, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"gpu-training-stack:{self.CLOUD}:Platform", name, None, opts)
        self.name = name
        self.spec = spec
        self.tags = stack_tags(spec)
        self.exports: dict[str, Any] = {}
        self.providers: dict[str, pulumi.ProviderResource] = {}
        for region in self.regions():
            self.providers[region] = self.make_provider(region)
        self.build()
        self.register_outputs(self.exports)

    # -- what subclasses provide -------------------------------------------------------
    def make_provider(self, region: str) -> pulumi.ProviderResource:
        raise TypeError(f"{type(self).__name__} must define make_provider")

    def build(self) -> None:
        """Create this cloud's resources. The foundation creates only the providers."""

    def export(self, vpc_ids: dict[str, pulumi.Output[str]], bucket: pulumi.Output[str], checkpoint_url: str,
               fleets: dict[str, pulumi.Output[list[str]]], clusters: dict[str, pulumi.Output[str]],
               kubeconfigs: dict[str, pulumi.Output[str]]) -> None:
        """The same stack outputs on every cloud; kubeconfigs stay secret."""
        self.exports = {"vpcIds": vpc_ids, "bucket": bucket, "checkpointUrl": checkpoint_url,
                        "fleets": fleets, "clusters": clusters, "kubeconfigs": pulumi.Output.secret(kubeconfigs)}

    # -- helpers ----------------------------------------------------------------------
    @property
    def account(self) -> CloudAccount:
        return self.spec.clouds[self.CLOUD]  # type: ignore[index]  # CLOUD is one of the Cloud literals

    def networks(self) -> list[Network]:
        return [n for n in self.spec.networks if n.cloud == self.CLOUD]

    def node_groups(self) -> list[NodeGroup]:
        return [g for g in self.spec.node_groups if g.cloud == self.CLOUD]

    def vm_groups(self) -> list[NodeGroup]:
        return [g for g in self.node_groups() if g.kind == "vm"]

    def kubernetes_groups(self) -> dict[str, list[NodeGroup]]:
        """Kubernetes node groups by network: each such network gets one cluster."""
        found: dict[str, list[NodeGroup]] = {}
        for g in self.node_groups():
            if g.kind == "kubernetes":
                found.setdefault(g.network, []).append(g)
        return found

    def regions(self) -> list[str]:
        found = [self.account.region] + [self.spec.region_of(n) for n in self.networks()]
        return list(dict.fromkeys(found))

    def peer_cidrs(self) -> dict[str, list[str]]:
        """For each of this cloud's networks, the CIDRs of the networks peered with it."""
        found: dict[str, list[str]] = {n.name: [] for n in self.networks()}
        for p in self.spec.peerings:
            if p.requester in found and p.accepter in found:
                found[p.requester].append(str(self.spec.network(p.accepter).cidr))
                found[p.accepter].append(str(self.spec.network(p.requester).cidr))
        return found

    def peerings(self) -> list[Peering]:
        names = {n.name for n in self.networks()}
        return [p for p in self.spec.peerings if p.requester in names]

    def child_opts(self, region: str | None = None, **kwargs: Any) -> pulumi.ResourceOptions:
        """Options for a direct child: parented here, on the region's provider."""
        provider = self.providers[region or self.account.region]
        return pulumi.ResourceOptions(parent=self, provider=provider, **kwargs)

    def provider_opts(self, region: str | None = None) -> pulumi.ResourceOptions:
        """Options for a child component: the region's provider, inherited by its children."""
        provider = self.providers[region or self.account.region]
        return pulumi.ResourceOptions(parent=self, providers=[provider])
