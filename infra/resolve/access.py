"""What each identity may do in the stack's bucket: least privilege, the same on every cloud.

- A node group's training identity (its nodes' role on VMs and TKE; the pods' own role on EKS
  and ACK) reads the dataset and writes only its own group's checkpoint prefix.
- Every node reads the node bundle (the scripts its user data fetches).
Nothing may write `datasets/` (datasets are put there by a person, `make dataset`) or another
group's checkpoints. Each cloud's access module turns these grants into its policy language.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.buckets import CHECKPOINT_PREFIX, DATASET_PREFIX, NODES_PREFIX
from infra.model.spec import StackSpec
from infra.resolve.groups import ResolvedGroup


@dataclass(frozen=True)
class Grants:
    reads: tuple[str, ...]  # prefixes listed and read
    writes: tuple[str, ...]  # prefixes listed, read, written and pruned

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.reads + self.writes))


def trainer_grants(spec: StackSpec, rg: ResolvedGroup) -> Grants:
    """The training run of one group: its dataset, its own checkpoints."""
    reads = (f"{DATASET_PREFIX}{spec.training.dataset}/",) if spec.training.dataset else ()
    return Grants(reads, (f"{CHECKPOINT_PREFIX}{rg.name}/",))


def node_grants(spec: StackSpec, rg: ResolvedGroup) -> Grants:
    """A VM (or TKE) node of one group: the node bundle, and the trainer's grants (it runs there)."""
    trainer = trainer_grants(spec, rg)
    return Grants((NODES_PREFIX, *trainer.reads), trainer.writes)


CLUSTER_NODE = Grants((NODES_PREFIX,), ())  # EKS / ACK nodes: the pods carry their own identity
