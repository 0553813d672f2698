"""The reference trainer's first act, before it imports torch (issue 44): the bucket's newest step
fetched by a process of its own (training/ckpt/fetch_process.py `prefetch`, the library's fast
path) while this one imports torch and builds the model. Imports no torch, numpy or the trainer's
loop.

`python -m training.trainer.train` calls `prefetch_early(sys.argv[1:])` before its own imports
(train.py's first lines). It reads the options as the trainer will (training/trainer/config.py,
quietly: a bad option or `--help` is said once, by the trainer's own parse, and nothing starts here)
and starts the fetch only where the trainer would prefetch from the bucket at all: a replicated
model (not `--sharding fsdp`, read shard by shard) and no peer store on the node (the peers may
hold a newer step: the trainer asks them first, training/ckpt/peer/tier.py). `prefetch` itself
starts nothing for a URL that is not a bucket's or a rank that shares its node; the trainer's
CheckpointManager takes the fetch and the run's lease it took, or drops them (another URL, other
settings) as the library's Checkpointer does.

Measured (the bench's store, alternating with the trainer that started its fetch after its
imports; docs/goodput-and-bench.md): ~1 GB resumed 3.20 / 3.29 s against 3.92 / 4.03 s (min /
median of four); ~100 MB 2.67 / 2.75 s against 2.73 / 2.77 s (six: there the model's build and
torch's compiler imports, not the fetch, are the wait). With the run's records read after the first
step (progress.py) as well: 2.82 / 2.87 s and 2.17 / 2.27 s."""

from __future__ import annotations

import contextlib
import io
import os


def prefetch_early(argv: list[str]) -> bool:
    """Start the fetch for the checkpoint URL these options give; True when one started."""
    from training.ckpt.fetch_process import prefetch
    from training.ckpt.peer.wire import ADDR_VAR
    from training.trainer import config

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cfg = config.parse(argv)
    except (Exception, SystemExit):  # noqa: BLE001 (the trainer's own parse says it, once)
        return False
    if cfg.sharding == "fsdp" or os.environ.get(ADDR_VAR):
        return False
    _local, remote = cfg.local_and_remote()
    # (A SIGTERM before the trainer's own handler, made with the run, ends the process as it always
    # did; the lease its fetch process took then lasts until it expires, and a restart of the same run,
    # GTS_RUN_ID, the node group or torchrun's run id, takes it over at once: lease.py `acquire`.)
    return bool(remote) and prefetch(remote)
