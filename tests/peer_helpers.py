"""A peer restore across real processes (issue 46: one fetch per node): stores as processes whose
log says each full copy they send, and a world of ranks (gloo on loopback, RANK / LOCAL_RANK as
torchrun exports them, LOCAL_WORLD_SIZE ranks per "node") that each open a tier and restore one
step. Run as `python -m tests.peer_helpers` it is one such rank; it prints its result as one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tests.training_helpers import RDZV_TEST_KEY, ROOT, free_port, wait_port
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link

KEY = RDZV_TEST_KEY.encode()
SENT_FULL = "sending the full copy of step"  # the store's line for each full copy it sends
RESULT = "RESULT "


@contextlib.contextmanager
def store_process(out: Any = subprocess.DEVNULL, **env: str) -> Iterator[str]:
    """A peer store process on loopback (its output to `out`, `env` added); yields its address."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "training.ckpt.peer.store", "--addr", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "RDZV_KEY": RDZV_TEST_KEY, "PYTHONPATH": str(ROOT), **env},
                            stdout=out, stderr=out)
    try:
        wait_port(port)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def logged_store(log: Path) -> Iterator[str]:
    """A peer store process on loopback, its log in `log`; yields its address."""
    with log.open("w") as out, store_process(out) as address:
        yield address


def payload(step: int, state: dict[str, Any] | None, rng: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"state": state, "rng": {"r": torch.tensor([rng])}, "step": step}, buffer)
    return buffer.getvalue()


def put(store: str, world: int, rank: int, step: int, kind: str, data: bytes, named: str = "",
        generation: str = "0-40") -> None:
    Link(KEY).put(store, world, rank, step, kind, data, named or wire.payload_digest(data), generation)


def restore(stores: list[str], share: Path, step: int, nodes: int = 2, per_node: int = 2) -> list[dict[str, Any]]:
    """Each rank's result of restoring `step` (node n's own store: stores[n]), in rank order."""
    port, world = free_port(), nodes * per_node
    procs = []
    try:
        for rank in range(world):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TEST_STORES": ",".join(stores), "TEST_SHARE": str(share),
                   "TEST_STEP": str(step)}
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.peer_helpers"], cwd=ROOT, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]
        results.append(json.loads(next(line for line in output.splitlines() if line.startswith(RESULT))[len(RESULT):]))
    return results


def _peak_mib() -> int:
    """This process's peak resident memory since its exec (VmHWM; ru_maxrss keeps the parent's)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) // 1024


def _rank() -> None:
    from training.distributed import Comm
    from training.ckpt.peer.tier import PeerTier

    comm = Comm("torchrun")
    tier = PeerTier(comm, 10, KEY, os.environ["TEST_STORES"].split(",")[comm.node], "")
    tier.share_root = tier.share_fallback = os.environ["TEST_SHARE"]
    from training.ckpt.peer import share
    dir_at_load = []  # whether the shared file's directory still existed when this rank read it
    read_open_file = share.load

    def load(fh: Any, path: str, named: str, what: str) -> tuple[dict[str, Any] | None, str]:
        dir_at_load.append(os.path.exists(os.path.dirname(path)))
        return read_open_file(fh, path, named, what)
    share.load = load
    before = _peak_mib()
    found = tier.load(int(os.environ["TEST_STEP"]))
    result = {"rank": comm.rank, "w": None if found is None else found[0]["w"][:4].tolist(),
              "grew_mib": _peak_mib() - before, "dir_at_load": dir_at_load,
              "rng": None if found is None or found[1] is None else int(found[1]["r"]), "refusals": tier.refusals}
    print(RESULT + json.dumps(result), flush=True)
    comm.close()


if __name__ == "__main__":
    _rank()
