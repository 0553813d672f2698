"""Issue 44: the reference trainer starts the bucket's fetch before it imports torch
(training/trainer/early.py, train.py's first lines): the fetch process it starts is the one its
CheckpointManager takes, lease included, and it starts nothing where the trainer would not fetch
from the bucket (sharded, a peer store on the node) or where its options are wrong (the trainer's
own parse says that once). A SIGTERM in the start leaves that lease to the same run's restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TRAIN_ARGS
from tests.test_fetch_lease import _lease
from tests.training_helpers import ROOT, MotoServer, storage_env
from training.ckpt import fetch_process
from training.trainer import early

# train.py run as `python -m training.trainer.train` does (as __main__), with `prefetch` reporting
# its call: the URL, whether a process started, whether torch was imported yet, and the process.
_WRAPPED = """
import runpy, sys
from training.ckpt import fetch_process
started = fetch_process.prefetch

def prefetch(url=None):
    ok = started(url)
    process = fetch_process._EARLY.get(url)
    print("EARLY", url, ok, "torch" in sys.modules, process.pid if process else None, flush=True)
    return ok

fetch_process.prefetch = prefetch
from training.ckpt import lease  # (imports no torch)
taking = lease.take

def take(*args, **kwargs):
    held = taking(*args, **kwargs)
    print("LEASE", (kwargs.get("handed") or {}).get("token"), held.token, flush=True)
    return held

lease.take = take  # before the manager's module binds it
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("training.trainer.train", run_name="__main__", alter_sys=True)
"""


def _train(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WRAPPED, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_the_trainer_fetches_before_torch_and_its_manager_takes_that_fetch(moto: MotoServer, tmp_path: Path) -> None:
    env = {**os.environ, **storage_env(moto.url)}
    url = f"s3://{moto.bucket}/{tmp_path.name}"
    args = [*TRAIN_ARGS, "--steps", "20", "--checkpoint-dir", url]
    first = _train(args, tmp_path, env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"EARLY {url} True False " in first.stdout  # (an empty bucket: its process takes the lease, finds no step)
    (tmp_path / "new-node").mkdir()  # an empty disk: the step comes from the bucket
    again = _train([*TRAIN_ARGS, "--steps", "30", "--checkpoint-dir", url, "--allow-config-change"],
                   tmp_path / "new-node", env)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    said = next(line.split() for line in again.stdout.splitlines() if line.startswith("EARLY "))
    assert said[1:4] == [url, "True", "False"], said  # started, before torch was imported
    assert f"fetched step-00000020 from {url} (into memory, by fetch process {said[4]}:" in out, out[-3000:]
    assert "resumed from step 20" in out and "final step=30" in out
    taken = next(line.split() for line in again.stdout.splitlines() if line.startswith("LEASE "))
    assert len(taken) == 3 and taken[1] == taken[2], taken  # the manager holds the very lease the fetch process took


# The trainer's start as far as its early fetch's lease, then a SIGTERM before its own handler (made
# with the run): the process ends as it always did, the lease left to expire.
_STARTED = """
import os, signal, sys
from training.trainer.early import prefetch_early
from training.ckpt import fetch_process
assert prefetch_early(sys.argv[1:])
said = fetch_process._EARLY[sys.argv[-1]].lease_line()
print("LEASE", said["lease"], said.get("shared"), flush=True)
if os.environ.get("TERM_NOW"):
    os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_sigterm_in_the_trainer_s_start_leaves_the_lease_to_a_restart_of_the_same_run(
        moto: MotoServer, tmp_path: Path) -> None:
    """Its lease then lasts until it expires: a restart of the same run (here GTS_RUN_ID; on a node
    the node group, under torchrun its run id) takes it over at once; another run is refused."""
    url = f"s3://{moto.bucket}/{tmp_path.name}"

    def start(run: str, term: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _STARTED, "--workload", "tiny", "--checkpoint-dir", url],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **storage_env(moto.url), "PYTHONPATH": str(ROOT), "GTS_RUN_ID": run,
                                   **({"TERM_NOW": "1"} if term else {})})

    killed = start("one", term=True)
    assert "LEASE held False" in killed.stdout and killed.returncode == -signal.SIGTERM, killed.stderr[-3000:]
    body = _lease(moto, url)
    assert body is not None and body["run"] == "run one"  # left: nothing gave it back
    again = start("one")
    assert "LEASE held True" in again.stdout, again.stdout + again.stderr[-3000:]  # taken over at once
    other = start("two")
    assert "LEASE refused" in other.stdout, other.stdout + other.stderr[-3000:]


@pytest.mark.parametrize("case", ["fsdp", "peer store", "bad option", "help", "local path"])
def test_nothing_starts_where_the_trainer_would_not_fetch_the_bucket(
        case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    asked: list[str | None] = []

    def prefetch(url: str | None = None) -> bool:
        asked.append(url)
        return True

    monkeypatch.setattr(fetch_process, "prefetch", prefetch)
    for var in ("GTS_PEER_STORE", "CHECKPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    args = ["--workload", "tiny", "--checkpoint-dir", "s3://bucket/run"]
    if case == "fsdp":
        args += ["--sharding", "fsdp"]
    elif case == "peer store":
        monkeypatch.setenv("GTS_PEER_STORE", "127.0.0.1:29501")
    elif case == "bad option":
        args += ["--steps", "many"]
    elif case == "help":
        args = ["--help"]
    else:
        args = ["--workload", "tiny", "--checkpoint-dir", str(tmp_path / "ck")]
    assert early.prefetch_early(args) is False
    assert asked == []
    assert capsys.readouterr() == ("", "")  # the trainer's own parse says a bad option, once
    monkeypatch.delenv("GTS_PEER_STORE", raising=False)
    assert early.prefetch_early(["--workload", "tiny", "--checkpoint-dir", "s3://bucket/run"]) is True
    assert asked == ["s3://bucket/run"]  # (the same options, none of the above: it starts)
