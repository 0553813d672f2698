"""Teams that share a cloud cannot reach each other's runs (issue 27): the rendezvous store.

The exploit (a pickled payload written under a run's id, which anyone can compute from the stack
file, and which torch's agents unpickle) on loopback with our own store and entrypoint. The
plan's rules around each store are tests/test_tenancy_stores.py; the clusters' NetworkPolicies
tests/test_tenancy_k8s.py; metrics addresses tests/test_tenancy_metrics.py; pods' credentials
tests/test_tenancy_credentials.py."""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests.training_helpers import BIN, ROOT, Run, free_port, kill_tree, retry_until, wait_port


KEY = "k" * 48


class Payload:
    """What an attacker writes: unpickling it runs a command (here: creates a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def run_id(group: str, checkpoint_url: str, steps: str) -> str:
    """The run's rendezvous id as training/node/entrypoint.sh computes it (from the stack's values)."""
    digest = hashlib.sha256(f"{checkpoint_url} {steps}".encode()).hexdigest()[:12]
    return f"{group}-{digest}"


def poison(port: int, rdzv_id: str, marker: Path) -> None:
    """Write the payload as the rendezvous state of `rdzv_id`, as torch's c10d backend stores it."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    client.set(f"torch.rendezvous.{rdzv_id}", base64.b64encode(pickle.dumps(Payload(marker))).decode())


def store(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "training.node.rdzv_store", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def node_env(port: int, tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "2", "MIN_NNODES": "2", "NPROC_PER_NODE": "1",
            "RDZV_ENDPOINT": f"127.0.0.1:{port}", "GTS_NODE_GROUP": "victim",
            "CHECKPOINT_URL": f"file://{tmp}/ckpt/", "TRAIN_STEPS": "50", "CHECKPOINT_DIR": str(tmp / "local"),
            **extra}


def test_a_poisoned_rendezvous_state_never_runs_in_a_node(tmp_path: Path) -> None:
    """The entrypoint's agent reads the payload, refuses it unread (no signature under the
    group's key) and stops; the payload never runs."""
    port = free_port()
    server = store(port)
    marker = tmp_path / "pwned"
    try:
        env = node_env(port, tmp_path, RDZV_KEY=KEY)
        poison(port, run_id("victim", env["CHECKPOINT_URL"], env["TRAIN_STEPS"]), marker)
        node = Run(subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh"), "--workload", "tiny"], env=env,
                                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        node.start_reader()
        try:
            assert node.finish(timeout=180) != 0, node.output[-3000:]
        finally:
            if node.proc.poll() is None:
                kill_tree(node.proc.pid)
        assert "not signed with this run's key" in node.output, node.output[-3000:]
        assert not marker.exists()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_same_payload_runs_in_an_unsigned_torchrun_agent(tmp_path: Path) -> None:
    """The exploit is real: torch's own c10d backend (what the entrypoint ran before) unpickles
    the payload in the agent."""
    port = free_port()
    server = store(port)
    marker = tmp_path / "pwned"
    agent = None
    try:
        poison(port, "victim-run", marker)
        agent = subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                  "--rdzv-id", "victim-run", "--rdzv-conf", "is_host=false",
                                  "-m", "training.trainer.train"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert retry_until(marker.exists, timeout=120), "the unsigned agent did not run the payload"
    finally:
        if agent is not None and agent.poll() is None:
            kill_tree(agent.pid)
            agent.wait(timeout=30)
        server.terminate()
        server.wait(timeout=10)


def test_a_state_signed_with_another_groups_key_is_refused(tmp_path: Path) -> None:
    """A group's nodes cannot write a state another group's agents accept: the signature is
    under the writer's key and the run's id."""
    from torch.distributed import FileStore  # type: ignore[attr-defined]
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    from training.node.rdzv_launch import SignedC10dBackend

    shared = FileStore(str(tmp_path / "store"), -1)
    theirs = SignedC10dBackend(shared, "run-a", b"a" * 48)
    ours = SignedC10dBackend(shared, "run-a", b"b" * 48)
    written = theirs.set_state(pickle.dumps({"round": 1}))
    assert written is not None and written[2]
    with pytest.raises(RendezvousStateError, match="not signed"):
        ours.get_state()
    # The same key under another run's id is refused too (no replay across runs).
    other_run = SignedC10dBackend(shared, "run-b", b"a" * 48)
    shared.set("torch.rendezvous.run-b", shared.get("torch.rendezvous.run-a").decode())
    with pytest.raises(RendezvousStateError, match="not signed"):
        other_run.get_state()
    assert theirs.get_state() is not None


def test_a_multi_node_run_without_a_key_never_starts(tmp_path: Path) -> None:
    port = free_port()
    env = node_env(port, tmp_path)
    env.pop("RDZV_KEY", None)
    proc = subprocess.run(["bash", str(ROOT / "training/node/entrypoint.sh")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "RDZV_KEY" in proc.stderr, proc.stderr[-2000:]


def test_the_store_listens_on_its_address_alone() -> None:
    """Bound to the address it is given (the instance's private address), not the wildcard that
    TCPStore's own server takes whatever host it is told."""
    port = free_port()
    server = store(port)
    try:
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True,
                                   check=True).stdout.split()
        assert f"127.0.0.1:{port}" in listening and f"*:{port}" not in listening, listening
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("value", ["", "short", "x" * 31])
def test_a_rendezvous_key_shorter_than_32_characters_is_refused_by_name(value: str) -> None:
    from training.node import rdzv_launch

    with pytest.raises(SystemExit, match="RDZV_KEY must hold the run's rendezvous key"):
        rdzv_launch.run_key({"RDZV_KEY": value})
