"""What every cloud's platform component shares: one explicit provider per region, tags, the
order in which a cloud's part of the stack is built, and the same stack outputs on every cloud.
Cloud modules subclass it and supply each concern."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import pulumi
import pulumi_random as random

from infra import rendezvous, userdata
from infra.buckets import bucket, image_key
from infra.capacity.places import zone_of
from infra.image import Registry, TrainerImage, TrainerImageArgs, build_provider, image_resource_name
from infra.model.spec import CloudAccount, Network, Peering
from infra.model.tags import stack_tags
from infra.rendezvous import Site
from infra.resolve.access import CLUSTER_NODE, Grants, node_grants
from infra.resolve.groups import ResolvedGroup, Stack
from infra.resolve.sharedfs import SharedFsOutputs

class TextStore(Protocol):
    """What every cloud's storage component offers the platform beyond its bucket."""

    def put_text(self, name: str, key: str, content: pulumi.Input[str], tags: dict[str, str]) -> pulumi.Resource:
        ...


SubnetT = TypeVar("SubnetT")
NetT = TypeVar("NetT")
StoreT = TypeVar("StoreT", bound=TextStore)
AccessT = TypeVar("AccessT")


@dataclass(frozen=True)
class Cluster:
    """A managed Kubernetes cluster as the stack outputs name it."""

    id: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]


class CloudPlatform(pulumi.ComponentResource, Generic[NetT, StoreT, AccessT], metaclass=abc.ABCMeta):
    """Base of `gpu-training-stack:<cloud>:Platform`.

    Subclasses set CLOUD and supply `make_provider` and the `make_*` steps (abstract: a cloud that
    leaves one out cannot be instantiated); `build()` calls them in the same order on every cloud. Providers are created here, one per region the spec
    uses, and passed to children explicitly (the stack files disable default providers).
    """

    CLOUD = ""

    def __init__(self, name: str, stack: Stack, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"gpu-training-stack:{self.CLOUD}:Platform", name, None, opts)
        self.name = name
        self.stack = stack
        self.spec = stack.spec
        # The stack's rendezvous stores on this cloud, placed once: build steps read them again and again.
        self._sites = tuple(s for s in rendezvous.sites(self.spec, stack.groups) if s.cloud == self.CLOUD)
        self.tags = stack_tags(self.spec)
        self.exports: dict[str, Any] = {}
        self.stores: dict[str, pulumi.Resource] = {}  # multi-node VM group -> its rendezvous store
        self.store_clients: dict[str, pulumi.Output[str]] = {}  # group -> the security group its store admits
        self.shared: dict[str, SharedFsOutputs] = {}  # network name -> its shared file system
        self.providers: dict[str, pulumi.ProviderResource] = {}
        for region in self.regions():
            self.providers[region] = self.make_provider(region)
        self.rdzv_keys = self.rendezvous_keys()
        self.rdzv_key_refs: dict[str, str] = {}  # group -> where its key is kept (make_key_secret)
        self.build()
        self.register_outputs(self.exports)

    def build(self) -> None:
        """Networks, the links between them, the bucket, node access, VM fleets, one cluster per
        network with Kubernetes groups, the budget; then the outputs."""
        nets = {net.name: self.make_network(net) for net in self.networks()}
        self.make_links(nets)
        storage = self.make_storage()
        self.shared = {net.name: self.make_shared_fs(net, nets[net.name], storage)
                       for net in self.networks() if net.shared_fs is not None}
        access = self.make_access(storage)
        images = self.trainer_images(nets)
        image = images.get(self.spec.training.image, pulumi.Output.from_input(""))
        of_group = {g.name: images.get(self.spec.base_image_of(g.group), image) for g in self.node_groups()}
        # Multi-node VM runs meet at their group's store; its fixed address is taken before any
        # fleet starts nodes in that subnet.
        self.stores = {site.group: self.make_rendezvous(site, nets[site.network], access, image)
                       for site in self.rendezvous_sites()}
        # Each multi-node group's rendezvous key in the cloud's secret store, readable by its
        # nodes alone: the user data names it, the node fetches it at boot.
        self.rdzv_key_refs = {g.name: self.make_key_secret(g, self.rdzv_keys[g.name], access)
                              for g in self.vm_groups() if g.name in self.rdzv_keys}
        fleets = {g.name: self.make_fleet(g, nets[g.network], access, of_group[g.name]) for g in self.vm_groups()}
        # Each VM group's current image where its nodes read it at every trainer start: the way a
        # new image reaches a node whose user data is never read again (a fixed instance).
        for g in self.vm_groups():
            storage.put_text(f"{self.spec.env}-{g.name}-image", image_key(g.name), of_group[g.name], self.tags)
        clusters: dict[str, Cluster] = {}
        for net_name, groups in self.kubernetes_groups().items():
            clusters[net_name] = self.make_cluster(self.spec.network(net_name), groups, nets[net_name], access,
                                                   storage, {g.name: of_group[g.name] for g in groups})
        self.make_budget()
        self.exports = {"vpcIds": {name: self.vpc_id(n) for name, n in nets.items()},
                        "bucket": self.bucket_name(storage), "checkpointUrl": self.checkpoint_root(),
                        "fleets": fleets, "clusters": {k: c.id for k, c in clusters.items()},
                        "kubeconfigs": pulumi.Output.secret({k: c.kubeconfig for k, c in clusters.items()}),
                        "trainerImage": image}

    def trainer_images(self, nets: dict[str, NetT]) -> dict[str, pulumi.Output[str]]:
        """Base image -> the trainer image built on it, by digest in this cloud's registry (built
        and pushed by the stack): the stack's `training.image` and each group's own; or the
        prebuilt image the spec names for this cloud, for every group."""
        prebuilt = self.spec.training.prebuilt_images.get(self.CLOUD)  # type: ignore[call-overload]
        if prebuilt:
            return {self.spec.training.image: pulumi.Output.from_input(str(prebuilt))}
        if not self.node_groups():
            return {}
        registry = self.make_registry(nets)
        bases = dict.fromkeys([self.spec.training.image] + [self.spec.base_image_of(g.group) for g in self.node_groups()])
        builder = build_provider(self.name, self)
        return {base: TrainerImage(image_resource_name(self.name, base, self.spec.training.image),
                                   TrainerImageArgs(base, registry, builder), opts=pulumi.ResourceOptions(parent=self)).ref
                for base in bases}

    # -- what subclasses provide -------------------------------------------------------
    @abc.abstractmethod
    def make_provider(self, region: str) -> pulumi.ProviderResource:
        ...

    @abc.abstractmethod
    def make_network(self, net: Network) -> NetT:
        ...

    @abc.abstractmethod
    def vpc_id(self, net: NetT) -> pulumi.Output[str]:
        ...

    def make_links(self, nets: dict[str, NetT]) -> None:
        """Peerings (and transit networks) between this cloud's networks."""

    @abc.abstractmethod
    def make_storage(self) -> StoreT:
        ...

    @abc.abstractmethod
    def bucket_name(self, storage: StoreT) -> pulumi.Output[str]:
        ...

    @abc.abstractmethod
    def make_shared_fs(self, net: Network, built: NetT, storage: StoreT) -> SharedFsOutputs:
        ...

    @abc.abstractmethod
    def make_access(self, storage: StoreT) -> AccessT:
        ...

    @abc.abstractmethod
    def make_registry(self, nets: dict[str, NetT]) -> Registry:
        ...

    @abc.abstractmethod
    def make_rendezvous(self, site: Site, net: NetT, access: AccessT, image: pulumi.Output[str]) -> pulumi.Resource:
        """The group's store instance; records its client security group in store_clients."""

    @abc.abstractmethod
    def make_key_secret(self, group: ResolvedGroup, key: pulumi.Output[str], access: AccessT) -> str:
        """The group's rendezvous key in the cloud's secret store, readable by the group's node
        role alone; returns what a node asks the store for (userdata.RDZV_KEY_REF)."""

    @abc.abstractmethod
    def make_fleet(self, group: ResolvedGroup, net: NetT, access: AccessT,
                   image: pulumi.Output[str]) -> pulumi.Output[list[str]]:
        ...

    @abc.abstractmethod
    def make_cluster(self, net: Network, groups: list[ResolvedGroup], built: NetT, access: AccessT,
                     storage: StoreT, images: Mapping[str, pulumi.Output[str]]) -> Cluster:
        ...

    @abc.abstractmethod
    def make_budget(self) -> None:
        ...

    # -- helpers ----------------------------------------------------------------------
    @property
    def account(self) -> CloudAccount:
        return self.spec.clouds[self.CLOUD]  # type: ignore[index]  # CLOUD is one of the Cloud literals

    def checkpoint_root(self) -> str:
        return bucket(self.spec, self.CLOUD).checkpoint_root

    def networks(self) -> list[Network]:
        return [n for n in self.spec.networks if n.cloud == self.CLOUD]

    def node_groups(self) -> list[ResolvedGroup]:
        return self.stack.of_cloud(self.CLOUD)

    def vm_groups(self) -> list[ResolvedGroup]:
        return [g for g in self.node_groups() if g.kind == "vm"]

    def kubernetes_groups(self) -> dict[str, list[ResolvedGroup]]:
        """Kubernetes node groups by network: each such network gets one cluster."""
        found: dict[str, list[ResolvedGroup]] = {}
        for g in self.node_groups():
            if g.kind == "kubernetes":
                found.setdefault(g.network, []).append(g)
        return found

    def fabric_networks(self, kind: str = "") -> set[str]:
        """This cloud's networks that hold a group (of `kind`, "vm" or "kubernetes", if given)
        with a multi-node fabric (infra/fabric.py)."""
        return {g.network for g in self.node_groups() if g.fabric is not None and kind in ("", g.kind)}

    def vm_networks(self) -> set[str]:
        """This cloud's networks that hold VM groups (they get the network's VM security group)."""
        return {g.network for g in self.vm_groups()}

    @staticmethod
    def spans_nodes(group: ResolvedGroup) -> bool:
        """A VM group whose run may span nodes: it gets a security group of its own that admits
        its own nodes alone, on every port (the collectives, torch's worker store)."""
        return rendezvous.multi_node_vm(group)

    def node_networks(self) -> list[Network]:
        """This cloud's networks that hold node groups."""
        used = {g.network for g in self.node_groups()}
        return [n for n in self.networks() if n.name in used]

    def rendezvous_sites(self) -> list[Site]:
        return list(self._sites)

    def access_grants(self) -> dict[str, Grants]:
        """Instance identities: each VM group's nodes, and each rendezvous store (the bundle only)."""
        grants = {g.name: node_grants(self.spec, g) for g in self.vm_groups()}
        return {**grants, **{site.name: CLUSTER_NODE for site in self.rendezvous_sites()}}

    def after_store(self, group: ResolvedGroup) -> list[pulumi.Resource]:
        """What a group's fleet waits for: its rendezvous store, if it has one."""
        store = self.stores.get(group.name)
        return [store] if store is not None and rendezvous.multi_node_vm(group) else []

    def zone_of(self, group: ResolvedGroup) -> str | None:
        """The zone candidate the group runs at (its activeCandidate), or None."""
        return zone_of(self.stack.declared or self.spec, group.name)

    def moved_to(self, group: ResolvedGroup) -> str | None:
        """The zone candidate's zone when it is not the network's first (where a one-zone fleet is as
        declared): the zone a one-zone resource (HCC, cluster placement group) is named after."""
        zone = self.zone_of(group)
        return zone if zone is not None and zone != self.spec.network(group.network).subnets[0].zone else None

    def fleet_subnets(self, group: ResolvedGroup, built: list[SubnetT]) -> tuple[list[SubnetT], list[str]]:
        """The subnets of the group's network its fleet launches into, with their zones: all of them,
        or at a zone candidate (activeCandidate, infra/capacity/places.py) that zone's only.
        `built`: the network's subnet resources, in the order of networks[].subnets."""
        zone = self.zone_of(group)
        pairs = [(b, s.zone) for b, s in zip(built, self.spec.network(group.network).subnets, strict=True)
                 if zone is None or s.zone == zone]
        return [b for b, _ in pairs], [z for _, z in pairs]

    def clients_of(self, group: ResolvedGroup) -> list[pulumi.Output[str]]:
        """The security group a group's nodes carry to reach its store (none without one)."""
        found = self.store_clients.get(group.name)
        return [found] if found is not None else []

    def rendezvous_keys(self) -> dict[str, pulumi.Output[str]]:
        """Each multi-node VM group's rendezvous key (training/node/rdzv_launch.py signs the rendezvous
        state with it): drawn once, kept as a secret in the state, and given to that group's
        nodes alone, through the cloud's secret store (make_key_secret). The stacks disable
        default providers: the random provider is explicit, like the clouds'."""
        groups = [g for g in self.vm_groups() if rendezvous.multi_node_vm(g)]
        if not groups:
            return {}
        provider = random.Provider(f"{self.name}-random", opts=pulumi.ResourceOptions(parent=self))
        return {g.name: random.RandomPassword(
            f"{self.name}-{g.name}-rdzv-key", length=rendezvous.KEY_LENGTH, special=False,
            opts=pulumi.ResourceOptions(parent=self, provider=provider)).result for g in groups}

    def store_user_data(self, site: Site, image: pulumi.Output[str]) -> pulumi.Output[str]:
        return image.apply(lambda ref: userdata.for_store(self.spec, site, ref))

    def store_instance_type(self) -> str:
        return str(rendezvous.instance(self.CLOUD)["instanceType"])

    def user_data(self, group: ResolvedGroup, image: pulumi.Output[str]) -> pulumi.Output[str]:
        """The group's user data, once the image's digest (and the shared file system's address,
        where the group mounts one) is known; a secret when it carries an MLflow URI (they often
        hold a token: `pulumi config set --secret --path training.mlflowTrackingUri`), so that it
        never shows in previews or the state in clear. It names the group's rendezvous key in
        the secret store, never the key itself."""
        shared = self.shared.get(group.network) if group.group.shared_fs else None
        ref = self.rdzv_key_refs.get(group.name)
        mount = shared.mount() if shared is not None else None
        rendered = pulumi.Output.all(image, mount).apply(
            lambda got: userdata.for_group(self.spec, group, got[0], got[1],
                                           {userdata.RDZV_KEY_REF: ref} if ref else None))
        return pulumi.Output.secret(rendered) if self.spec.training.mlflow_tracking_uri else rendered

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

    def region_of(self, net: Network | str) -> str:
        return self.spec.region_of(self.spec.network(net) if isinstance(net, str) else net)

    def provider(self, region: str | None = None) -> pulumi.ProviderResource:
        return self.providers[region or self.account.region]

    def child_opts(self, region: str | None = None, **kwargs: Any) -> pulumi.ResourceOptions:
        """Options for a direct child: parented here, on the region's provider."""
        return pulumi.ResourceOptions(parent=self, provider=self.provider(region), **kwargs)

    def provider_opts(self, region: str | None = None) -> pulumi.ResourceOptions:
        """Options for a child component: the region's provider, inherited by its children."""
        return pulumi.ResourceOptions(parent=self, providers=[self.provider(region)])
