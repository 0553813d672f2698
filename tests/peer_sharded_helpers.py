"""Sharded state through the peer tier across real processes (issue 46): a world of ranks (gloo on
loopback, RANK / LOCAL_RANK as torchrun exports them, LOCAL_WORLD_SIZE ranks per "node"), each
training the gpt-tiny model under FSDP2, then either saving (a durable sharded step to a file://
bucket, then a peer copy of a later step into its own node's store and its buddy's) or restoring
the newest step the stores, the disk or the bucket hold into a fresh model of this world's
sharding. Run as `python -m tests.peer_sharded_helpers` it is one such rank; it prints its result
as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.peer_helpers import KEY, RESULT
from tests.training_helpers import ROOT, free_port

DURABLE, PEER = 2, 4  # the step saved to disk and bucket, the later one copied to the peer stores


def ranks(mode: str, stores: list[str], tmp: Path, nodes: int, per_node: int, **extra: str) -> list[dict[str, Any]]:
    """Each rank's result (rank order) of a world of `nodes` x `per_node` ranks in `mode` (save,
    restore, skip or no-room; `extra`: more environment); node n's own store: stores[n]; disks under tmp/disk-<n>, the bucket tmp/bucket."""
    port, world = free_port(), nodes * per_node
    (tmp / "share").mkdir(exist_ok=True)
    procs = []
    try:
        for rank in range(world):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank),
                   "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TEST_MODE": mode,
                   "TEST_STORES": ",".join(stores), "TEST_TMP": str(tmp), **extra}
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.peer_sharded_helpers"], cwd=ROOT, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
        result = json.loads(next(line for line in output.splitlines() if line.startswith(RESULT))[len(RESULT):])
        results.append({**result, "output": output})
    return results


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 64, (4, 17), generator=generator)
    logits = model(tokens[:, :-1])
    torch.autograd.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
    optimizer.step()
    optimizer.zero_grad()


def optim_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the whole optimizer state (every parameter's step count and moments, the groups),
    gathered to rank 0 (collective; "" on the other ranks)."""
    import hashlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return ""
    digest = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            digest.update(repr(value).encode())
    walk(full)
    return digest.hexdigest()


def _save(peer: Any, sharded: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
          world: int) -> dict[str, Any]:
    """Train to PEER: a durable step at DURABLE, a peer copy at PEER; the full parameters of both."""
    from training.ckpt.checkpointer import rng_state
    from training.ckpt.sharded import full_params_sha256

    hashes: dict[int | str, str] = {}
    result: dict[str, Any] = {}
    for step in range(1, PEER + 1):
        _train(model, optimizer, step, rank)
        state = {"step": step, "world_size": world}
        if step == DURABLE:
            sharded.save(step, model, optimizer, state, rng_state())
        if step == PEER:  # gathered before the copy: no collective of the test's beside its background write
            hashes["optim"] = optim_sha256(model, optimizer)
            result["blocked_s"] = peer.copy(step, state, rng_state())
        if step in (DURABLE, PEER):
            hashes[step] = full_params_sha256(model)
    peer.close()
    return {**result, "hashes": hashes, "sent": peer.sent, "error": peer.error, "draw": float(torch.rand(1))}


def _skip(peer: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
          ) -> dict[str, Any]:
    """A copy still on its way on some rank: the next one is skipped on every rank."""
    from training.ckpt.checkpointer import rng_state

    _train(model, optimizer, 1, rank)
    peer.copy(DURABLE, {"step": DURABLE, "world_size": world}, rng_state())
    if rank == 0 and peer._sender is not None:
        peer._sender.join()  # rank 0's stores answer; the others' buddy or own store never does
    peer.comm.barrier()
    peer.copy(PEER, {"step": PEER, "world_size": world}, rng_state())
    peer.close(timeout_s=0)
    return {"sent": peer.sent, "skipped": peer.skipped}


def _no_room(peer: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
             ) -> dict[str, Any]:
    """Rank 1 has no place to write its copy: none is made on any rank (no rank left in DCP's
    collective save alone); with room again, the next copy is made."""
    from training.ckpt.checkpointer import rng_state

    _train(model, optimizer, 1, rank)
    roots = (peer.tier.share_root, peer.tier.share_fallback)
    if rank == 1:
        peer.tier.share_root = peer.tier.share_fallback = os.environ["TEST_NO_ROOM"]  # a file: no directory in it
    peer.copy(DURABLE, {"step": DURABLE, "world_size": world}, rng_state())
    error = peer.error
    peer.tier.share_root, peer.tier.share_fallback = roots
    peer.copy(PEER, {"step": PEER, "world_size": world}, rng_state())
    peer.close()
    return {"sent": peer.sent, "skipped": peer.skipped, "error": error}


def _restore(peer: Any, sharded: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The newest step from peers, disk or bucket into this world's sharding; what came back."""
    from training.ckpt.checkpointer import set_rng_state
    from training.ckpt.peer import sharded as peer_sharded
    from training.ckpt.sharded import full_params_sha256

    result: dict[str, Any] = {}
    found = peer_sharded.choose(sharded, peer)
    if found is not None:
        result.update(from_peer=peer.folder is not None,
                      files=sorted(os.listdir(peer.folder)) if peer.folder is not None else [])
        peer_sharded.restore(sharded, peer, found.step, model, optimizer, found.state["world_size"])
        result.update(step=found.step, rng=found.rng is not None, state_step=found.state["step"])
        if found.rng is not None:  # the streams go on as the saving rank's would have
            set_rng_state(found.rng)
            result.update(draw=float(torch.rand(1)))
    tier, comm = peer.tier, peer.comm
    result.update(hash=full_params_sha256(model), optim=optim_sha256(model, optimizer), refusals=peer.refusals,
                  listing=tier.link.listing(tier.stores[comm.node]) if comm.local_rank == 0 else [])
    peer.close()
    return result


def _rank() -> None:
    import logging

    from training.ckpt.manager import CheckpointManager, Topology
    from training.ckpt.peer.sharded import ShardedPeer
    from training.ckpt.peer.tier import PeerTier
    from training.ckpt.sharded import ShardedCheckpoints, shard
    from training.distributed import Comm
    from training.trainer.models import TinyGPT

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    comm, tmp, mode = Comm("torchrun"), Path(os.environ["TEST_TMP"]), os.environ["TEST_MODE"]
    torch.manual_seed(0 if mode == "save" else 1)  # a restore starts from other values than the saved ones
    dim, layers = (int(x) for x in os.environ.get("TEST_GPT", "32,2").split(","))  # width, blocks
    built = TinyGPT(64, dim, layers, 4, 16)
    model = shard(built, list(built.blocks), comm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # each rank its own streams (the model above is the same on all): a rank given another's is seen
    torch.manual_seed((100 if mode == "save" else 200) + comm.rank)
    tier = PeerTier(comm, PEER, KEY, os.environ["TEST_STORES"].split(",")[comm.node], "")
    tier.share_root = str(tmp / "share")
    topo = Topology(comm.rank, comm.local_rank, comm.world, comm.node, comm.nnodes, comm.local_world)
    manager = CheckpointManager(str(tmp / f"disk-{comm.node}"), f"file://{tmp / 'bucket'}", topo, keep=5)
    sharded = ShardedCheckpoints(manager, comm, background=False)
    peer = ShardedPeer(tier, model, optimizer)
    if mode == "save":
        result = _save(peer, sharded, model, optimizer, comm.rank, comm.world)
    elif mode in ("skip", "no-room"):
        result = (_skip if mode == "skip" else _no_room)(peer, model, optimizer, comm.rank, comm.world)
    else:
        result = _restore(peer, sharded, model, optimizer)
    sharded.close()
    manager.close()
    print(RESULT + json.dumps({"rank": comm.rank, **result}), flush=True)
    comm.close()


if __name__ == "__main__":
    _rank()
