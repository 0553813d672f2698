"""Where and with what settings a fetch process runs (training/ckpt/fetch_process.py): this rank's
place from torchrun's environment before torch is imported, the settings a fetch is used with,
and whether it takes the run's lease. Imports nothing heavy: `prefetch` runs before torch."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

# Launchers whose own variables place the ranks (training/distributed.py reads horovod's through horovod).
OTHER_LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "HOROVOD_SIZE", "SLURM_NTASKS", "MV2_COMM_WORLD_SIZE")


def env_topology(env: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """This rank's place as torchrun's environment gives it (training/distributed.py's Comm reads
    the same variables), before torch is imported; None under another launcher (MPI, horovod,
    Slurm: their own variables say which ranks share a node, and a guess could have every rank
    of a node fetch the whole step into memory)."""
    env = os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" not in env and any(env.get(name, "1") != "1" for name in OTHER_LAUNCHERS):
        return None  # (a launcher's size of 1, a one-task Slurm job: one rank, alone on its node)
    try:
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        local_world, local_rank = int(env.get("LOCAL_WORLD_SIZE", world)), int(env.get("LOCAL_RANK", 0))
    except ValueError:  # not torchrun's numbers: the Checkpointer, made later, says what is wrong
        return None
    return {"rank": rank, "local_rank": local_rank, "world_size": world,
            "node": rank // max(1, local_world), "nnodes": max(1, world // max(1, local_world)),
            "local_world_size": local_world}


def key(url: str) -> str:
    return url.rstrip("/")


# What decides which store a URL reads, as whom, and for which run (training/ckpt/storage.py's
# location, training/credentials.py and each cloud's pod identity, botocore's configuration files
# under HOME, the proxies and CA bundles, training/ckpt/lease.py's run_identity and TTL): a fetch
# process is used only while these are what they were when it started.
SETTINGS = ("STORAGE_", "AWS_", "ALIBABA_CLOUD_", "TENCENTCLOUD_", "TKE_", "GTS_RUN_ID", "GTS_NODE_GROUP", "GTS_CLOUD",
            "GTS_METADATA_URL", "GTS_LEASE_TTL_S", "TORCHELASTIC_RUN_ID", "HOME", "SSL_CERT_", "REQUESTS_CA_BUNDLE", "FSSPEC_")


def settings(url: str, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    chosen = sorted((key, value) for key, value in env.items()
                    if key.startswith(SETTINGS) or key.lower().endswith("_proxy"))
    return hashlib.sha256(json.dumps([key(url), chosen]).encode()).hexdigest()


def leases(topology: Mapping[str, int], env: Mapping[str, str] | None = None) -> bool:
    """Whether `prefetch`'s process takes the run's lease for this process: global rank 0 as
    torchrun's RANK says, or a process with no sign of a run of several nodes (RANK unset is
    taken as 0 only then: a launcher that sets it later, one process per node, would have every
    node take it)."""
    env = os.environ if env is None else env
    if topology["rank"] != 0:
        return False
    hints = ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK") + (("WORLD_SIZE",) if env.get("WORLD_SIZE", "1") != "1" else ())
    return "RANK" in env or not any(name in env for name in hints)
