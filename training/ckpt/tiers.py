"""Where a committed step can come from: the narrowest thing this node's disk, the run's bucket and
a peer's memory (training/ckpt/peer/tier.py) have in common, as a restore uses them. Each lists the
steps this rank can get there and loads one; what lies under that differs (files checked against
their manifests, one verified GET per file through fsspec, a digest-checked copy from another
node's store) and stays behind it. The manager holds the disk and bucket tiers (`tiers`, nearest
first); a run with the peer tier asks it before them (training/ckpt/peer/tier.py's choose).

Not yet the path a restore takes: choose_checkpoint still calls the manager's `load` (disk, then
bucket, inside the Loader, with its prefetch) and the peer tier's `load` directly; moving it onto
this protocol would change its log lines and the order sources are tried, a step of its own. The
semantics differ where noted: disk and bucket raise CheckpointError for a step they lack, the peer
tier answers None; the peer tier's `load` is collective (every rank calls it), the others are not."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tier(Protocol):
    name: str  # "disk", "bucket", "peer": how log lines name where a step came from

    def steps(self) -> set[int]:
        """The steps this rank can get here (each checked when loaded)."""

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """(training state, this rank's per-rank state or None) of `step`. CheckpointError where
        the step is there but damaged; None where the tier does not give it after all (the peer
        tier, on every rank alike)."""
