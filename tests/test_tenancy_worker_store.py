"""Issue 41: the workers' own store (where `init_process_group` meets, MASTER_ADDR:MASTER_PORT)
of a multi-node run listens on the rank-0 node's address alone. Before, torch's rank-0 *worker*
hosted it on every interface (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), unauthenticated and outside
the signed rendezvous: a client with no key listed and wrote its keys. Two loopback "nodes" whose
address is 127.0.0.1 run through the image's entrypoint; a client on another address of the same
host (what a node of another team is to a wildcard socket) finds nothing listening there."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.training_helpers import BIN, RDZV_TEST_KEY, ROOT, Run, free_port, kill_tree, retry_until

NODE_ADDRESS = "127.0.0.1"  # the nodes' (and their store's) private address
OTHER_ADDRESS = "127.0.0.5"  # the same host, another address: a wildcard socket answers there


def environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def worker_store(group: str) -> tuple[str, int] | None:
    """MASTER_ADDR and MASTER_PORT of the run's rank-0 worker, once it runs."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        env = environ(pid)
        if env.get("GTS_NODE_GROUP") == group and env.get("RANK") == "0" and "MASTER_PORT" in env:
            return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    return None


def listening(port: int) -> list[str]:
    return subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True,
                          check=True).stdout.split()


def test_the_workers_store_listens_on_the_nodes_address_alone(tmp_path: Path) -> None:
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "training.node.rdzv_store", "--host", NODE_ADDRESS,
                              "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    group = f"victim-{os.getpid()}"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "2", "MIN_NNODES": "2", "NPROC_PER_NODE": "1",
           "RDZV_ENDPOINT": f"{NODE_ADDRESS}:{port}", "GTS_NODE_GROUP": group, "RDZV_KEY": RDZV_TEST_KEY,
           "CHECKPOINT_URL": f"file://{tmp_path}/ckpt/", "TRAIN_STEPS": "100000"}
    nodes: list[Run] = []
    try:
        for i in range(2):
            run = Run(subprocess.Popen(
                ["bash", str(ROOT / "training/node/entrypoint.sh"), "--workload", "tiny", "--throttle-ms", "20",
                 "--checkpoint-every", "100000"], env={**env, "CHECKPOINT_DIR": str(tmp_path / f"node{i}")},
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            run.start_reader()
            nodes.append(run)
        found: list[tuple[str, int]] = []

        def serving() -> bool:
            if not found and (where := worker_store(group)):
                found.append(where)
            return bool(found) and bool(listening(found[0][1]))

        assert retry_until(serving, timeout=240), "\n---\n".join(n.output[-2000:] for n in nodes)
        address, worker_port = found[0]
        assert address == NODE_ADDRESS
        sockets = listening(worker_port)
        assert f"{NODE_ADDRESS}:{worker_port}" in sockets, sockets
        assert not {f"*:{worker_port}", f"0.0.0.0:{worker_port}", f"[::]:{worker_port}"} & set(sockets), sockets
        with socket.socket() as client:
            assert client.connect_ex((OTHER_ADDRESS, worker_port)) != 0, "the workers' store answers another address"
        assert all(n.proc.poll() is None for n in nodes), "\n---\n".join(n.output[-2000:] for n in nodes)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                kill_tree(n.proc.pid)
            n.proc.wait(timeout=60)
        store.terminate()
        store.wait(timeout=10)
