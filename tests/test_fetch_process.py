"""Issue 44's fetch process (training/ckpt/fetch_process.py): the only rank on its node resuming
from the bucket has the newest step fetched by a process of its own, started before torch is
imported (`prefetch`) or by the Checkpointer made before the model, and maps the memory files it
received. Tested against moto with real processes: the step resumed bit for bit through the
process, the early fetch taken by both documented paths, a fetch process that dies or finds a bad
step, one that outlives its caller, and answers of the wrong shape."""

from __future__ import annotations

import fcntl
import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.test_resume_memory import _memory_files
from tests.training_helpers import ROOT, MotoServer, storage_env
from training.ckpt import fetch_process
from training.ckpt.checkpointer import Checkpointer
from training.ckpt.fetch_process import FetchProcess

WAIT_S = 120.0  # a bound on waiting for an event (a process's end), never a figure


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()


@pytest.fixture
def url(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield from two_steps(moto, tmp_path, monkeypatch)


def two_steps(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A bucket prefix of this test's own holding steps 1 and 2 (two and four steps trained)."""
    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "NODE_RANK", "GROUP_RANK",
                "GTS_RUN_ID", "GTS_NODE_GROUP", "TORCHELASTIC_RUN_ID", "GTS_LEASE_TTL_S"):  # one process, its own run
        monkeypatch.delenv(key, raising=False)
    prefix = f"s3://{moto.bucket}/{tmp_path.name}"
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(url=prefix, local_dir=str(tmp_path / "writer"), upload_deadline_s=120, model=model,
                      optimizer=opt) as ckpt:
        _train(model, opt, range(0, 2))
        ckpt.save(1)
        _train(model, opt, range(2, 4))
        ckpt.save(2)
    (tmp_path / "step2.pt").write_bytes(b"")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "step2.pt")
    yield prefix
    fetch_process.drop()


def _fast_resume(url: str, disk: Path) -> tuple[Checkpointer, nn.Module, int]:
    ckpt = Checkpointer(url=url, local_dir=str(disk))
    with torch.device("meta"):
        model = _net()
    model = model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ckpt, model, ckpt.track(model=model, optimizer=opt).resume(assign=True)


def test_a_checkpointer_made_before_the_model_resumes_through_a_fetch_process(
        url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gts.checkpoint")
    ckpt, model, step = _fast_resume(url, tmp_path / "disk")
    try:
        fetcher = ckpt.manager.loader.prefetched.fetcher
        assert isinstance(fetcher, FetchProcess)
        assert step == 2
        assert f"fetched step-00000002 from {url} (into memory, by fetch process {fetcher.pid}:" in caplog.text
        opened, mapped = _memory_files()  # the model's tensors are the pages the fetch process wrote, mapped shared
        assert opened == [], opened  # the received descriptors are closed: the mapping alone holds the pages
        assert mapped and all("memfd:gts-step-00000002-model.pt" in line and " rw-s " in line for line in mapped), mapped
        assert fetcher.proc.poll() is not None  # the process is gone
        saved = torch.load(tmp_path / "step2.pt", weights_only=True)
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), name
        assert not list((tmp_path / "disk").rglob("step-00000002"))  # no disk copy
    finally:
        ckpt.close()


def test_the_descriptors_it_hands_over_are_closed_on_exec(url: str) -> None:
    fetcher = FetchProcess(url, fetch_process.env_topology() or {})
    try:
        fetched = fetcher.answer()
        assert fetched.step == 2 and list(fetched.paths) == ["model.pt", "rng-rank00000.pt"], fetched
        for path in fetched.paths.values():
            assert fcntl.fcntl(int(path.name), fcntl.F_GETFD) & fcntl.FD_CLOEXEC, path
    finally:
        fetcher.close()
    assert fetcher.answer().paths == {}  # closed: it names no descriptor any more


def test_a_socket_numbered_past_1024_works_and_a_close_before_the_answer_fetches_nothing(
        url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process with many descriptors open (torch, NCCL, a dataset) hands the fetch process a
    socket numbered 1024 or more; and a manager closed before the answer (a refused store) stops
    the process without fetching the step on its own thread instead."""
    caplog.set_level(logging.INFO, logger="gts.checkpoint")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"at most {hard} descriptors here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        fetcher = FetchProcess(url, fetch_process.env_topology() or {})
        try:
            assert fetcher.answer().step == 2
        finally:
            fetcher.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    ckpt = Checkpointer(url=url, local_dir=str(tmp_path / "disk"))
    taken = ckpt.manager.loader.prefetched.fetcher
    assert isinstance(taken, FetchProcess)
    ckpt.manager.close(timeout=0)  # before anything resumed
    assert taken.proc.poll() is not None
    assert "fetched step-00000002" not in caplog.text  # neither mapped nor fetched on the thread instead


def test_an_early_fetch_for_another_url_is_dropped_and_one_with_a_slash_is_taken(
        url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gts.checkpoint")
    assert fetch_process.prefetch(url + "-other")
    other = fetch_process._EARLY[url + "-other"]
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(url=url, local_dir=str(tmp_path / "disk1"), model=model, optimizer=opt) as ckpt:
        assert fetch_process._EARLY == {} and other.proc.poll() is not None  # dropped as the manager was made
        assert ckpt.resume() == 2
    assert "by fetch process" not in caplog.text
    assert fetch_process.prefetch(url + "/")
    mine = fetch_process._EARLY[url]
    with Checkpointer(url=url, local_dir=str(tmp_path / "disk2"), model=model, optimizer=opt) as ckpt:
        assert ckpt.resume() == 2  # the three lines take it too
    assert f"(into memory, by fetch process {mine.pid}:" in caplog.text


_EARLY_SCRIPT = """
import logging, sys
from training.ckpt import fetch_process
url, disk, plain = sys.argv[1], sys.argv[2], sys.argv[3] == "plain"
assert fetch_process.prefetch(url)
pid = fetch_process._EARLY[url].pid
assert "torch" not in sys.modules
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
import torch
from torch import nn
from training.ckpt.checkpointer import Checkpointer
net = lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
if plain:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(url=url, local_dir=disk, model=model, optimizer=opt)
    step = ckpt.resume()
else:
    ckpt = Checkpointer(url=url, local_dir=disk)
    with torch.device("meta"):
        model = net()
    model = model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ckpt.track(model=model, optimizer=opt).resume(assign=True)
torch.save(model.state_dict(), disk + "/resumed.pt")
print(f"early fetch {pid} resumed step {step}", flush=True)
ckpt.close()
"""


@pytest.mark.parametrize("path", ["fast", "plain"])
def test_a_fetch_started_before_torch_is_taken_by_either_documented_path(url: str, tmp_path: Path, path: str) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_EARLY_SCRIPT), url, str(disk), path], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    pid = int(run.stdout.split("early fetch ")[1].split()[0])
    assert "resumed step 2" in run.stdout
    assert f"(into memory, by fetch process {pid}:" in run.stdout, run.stdout[-2000:]
    saved, resumed = torch.load(tmp_path / "step2.pt"), torch.load(disk / "resumed.pt")
    assert saved.keys() == resumed.keys() and all(torch.equal(saved[k], resumed[k]) for k in saved)


def test_a_fetch_process_that_dies_leaves_the_fetch_to_the_thread(url: str, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gts.checkpoint")
    assert fetch_process.prefetch(url)
    early = fetch_process._EARLY[url]
    early.proc.kill()  # before it has even imported its modules: it answers nothing
    ckpt, model, step = _fast_resume(url, tmp_path / "disk")
    try:
        assert ckpt.manager.loader.prefetched.fetcher is early  # taken, found dead
        assert step == 2
        assert f"the fetch process ended without an answer (exit status {-signal.SIGKILL})" in caplog.text
        assert f"fetched step-00000002 from {url} (into memory: the only rank" in caplog.text  # by the thread
        saved = torch.load(tmp_path / "step2.pt", weights_only=True)
        assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())
    finally:
        ckpt.close()


def test_a_bad_step_the_fetch_process_finds_is_skipped_by_the_resume_and_said_once(
        url: str, moto: MotoServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gts.checkpoint")
    key = f"{url.split('/', 3)[3]}/step-00000002/model.pt"
    s3 = moto.client()
    body = bytearray(s3.get_object(Bucket=moto.bucket, Key=key)["Body"].read())
    body[-100] ^= 0xFF  # same size, one byte flipped: only the digest can tell
    s3.put_object(Bucket=moto.bucket, Key=key, Body=bytes(body))
    ckpt, _, step = _fast_resume(url, tmp_path / "disk")
    try:
        assert step == 1
        fetcher = ckpt.manager.loader.prefetched.fetcher
        assert isinstance(fetcher, FetchProcess)
        assert f"prefetch: fetch process {fetcher.pid}: CheckpointError: model.pt in {url} does not match" in caplog.text
        skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping checkpoint step 2")]
        assert len(skipped) == 1 and "model.pt" in skipped[0], skipped
    finally:
        ckpt.close()


_CALLER = """
import sys
from training.ckpt import fetch_process
assert fetch_process.prefetch("s3://silent/run")
print(fetch_process._EARLY["s3://silent/run"].pid, flush=True)
sys.stdin.read()
"""


def test_the_fetch_process_ends_with_its_caller(tmp_path: Path) -> None:
    """Its caller is killed while it waits on a store that took its connection and never answers
    (the store is this test's, so it outlives the caller): it exits anyway."""
    store = socket.socket()
    store.bind(("127.0.0.1", 0))
    store.listen(8)
    store.settimeout(WAIT_S)
    env = {**os.environ, **storage_env(f"http://127.0.0.1:{store.getsockname()[1]}"), "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CALLER)], cwd=tmp_path, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    connection: socket.socket | None = None
    try:
        assert caller.stdout is not None
        assert select.select([caller.stdout], [], [], WAIT_S)[0], "the caller printed no fetch process"
        pid = int(caller.stdout.readline())
        fetch = os.pidfd_open(pid)  # readable once the process has ended (a zombie or gone): an event to wait on
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(caller.pid)  # its parent
        connection, _ = store.accept()  # its request to the store: it is mid-fetch, waiting for an answer
        assert not select.select([fetch], [], [], 0)[0]
    finally:
        caller.kill()
        caller.wait()
    try:
        ended, _, _ = select.select([fetch], [], [], WAIT_S)  # the end of its socket: it exits, mid-request
        if not ended:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the fetch process outlived its caller")
        os.close(fetch)
    finally:
        if connection is not None:
            connection.close()
        store.close()


def test_by_hand_it_says_what_it_is_and_never_imports_torch() -> None:
    run = subprocess.run([sys.executable, "-m", "training.ckpt.fetcher"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert run.returncode == 2 and "started by the checkpoint library" in run.stderr and "Traceback" not in run.stderr
    probe = subprocess.run([sys.executable, "-c", "import sys\nfrom training.ckpt import fetch_process, fetcher, loader, "
                            "memory, storage\nfetch_process.prefetch('file:///nowhere')\nprint(sorted(m for m in sys.modules "
                            "if m.split('.')[0] == 'torch'))"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr


def _answered(reply: object, sizes: list[int]) -> fetch_process.Fetched:
    """FetchProcess._check of `reply` with memory files of `sizes` as its descriptors (no process)."""
    fetcher = FetchProcess.__new__(FetchProcess)
    fetcher.proc = SimpleNamespace(wait=lambda: 9)  # type: ignore[assignment]
    fetcher._reap = threading.Lock()
    fetcher._fds = []
    for size in sizes:
        fd = os.memfd_create("answer")
        os.ftruncate(fd, size)
        fetcher._fds.append(fd)
    try:
        return fetcher._check(reply)
    finally:
        for fd in fetcher._fds:
            os.close(fd)


@pytest.mark.parametrize("reply, sizes, why", [
    ({}, [], "ended without an answer (exit status 9)"),
    ({"step": 3, "files": {"model.pt": {"size": 10}}}, [10, 10], "2 descriptors for the files ['model.pt']"),
    ({"step": 3, "files": {"model.pt": {"size": 10}}}, [], "0 descriptors"),
    ({"step": 3, "files": {"../model.pt": {"size": 10}}}, [10], "descriptors for the files ['../model.pt']"),
    ({"step": 3, "files": {"model.pt": {"size": 10}}}, [11], "model.pt has 11 bytes"),
    ({"step": "3", "files": {"model.pt": {"size": 10}}}, [10], "no step in the bucket"),
    ([1, 2], [], "ended without an answer"),
])
def test_an_answer_of_the_wrong_shape_is_not_used(reply: object, sizes: list[int], why: str) -> None:
    fetched = _answered(reply, sizes)
    assert fetched.paths == {} and why in fetched.why and not fetched.fault


def test_a_well_formed_answer_names_its_memory_files_and_a_fault_is_left_to_the_resume() -> None:
    fetched = _answered({"step": 3, "files": {"model.pt": {"size": 10}, "rng-rank00000.pt": {"size": 4}}}, [10, 4])
    assert fetched.step == 3 and list(fetched.paths) == ["model.pt", "rng-rank00000.pt"]
    assert all(str(path).startswith("/proc/self/fd/") for path in fetched.paths.values())
    fault = _answered({"fault": "CheckpointError: model.pt does not match its digest"}, [])
    assert fault.fault and fault.paths == {} and "digest" in fault.why


def test_prefetch_starts_nothing_where_the_step_would_not_go_to_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHECKPOINT_URL", raising=False)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")  # mpirun: its variables, not torchrun's, place the ranks
    assert not fetch_process.prefetch("s3://bucket/run")
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not fetch_process.prefetch("file:///tmp/checkpoints")  # a local read needs no process
    assert not fetch_process.prefetch("/tmp/checkpoints")
    assert not fetch_process.prefetch("")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # ranks of one node share one copy on disk
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not fetch_process.prefetch("s3://bucket/run")
    assert fetch_process._EARLY == {}


def test_the_place_of_the_rank_comes_from_torchrun_s_variables_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    one = {"rank": 0, "local_rank": 0, "world_size": 1, "node": 0, "nnodes": 1, "local_world_size": 1}
    assert fetch_process.env_topology({}) == one
    assert fetch_process.env_topology({"SLURM_NTASKS": "1"}) == one  # a one-task job
    assert fetch_process.env_topology({"SLURM_NTASKS": "4"}) is None  # srun's ranks: not torchrun's variables
    assert fetch_process.env_topology({"SLURM_NTASKS": "4", "LOCAL_WORLD_SIZE": "1"}) == one  # torchrun inside it
    assert fetch_process.env_topology({"RANK": "first"}) is None
    assert fetch_process.env_topology({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == {
        "rank": 3, "local_rank": 1, "world_size": 4, "node": 1, "nnodes": 2, "local_world_size": 2}
    import multiprocessing.process

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(multiprocessing.process.current_process(), "_inheriting", True, raising=False)
    assert not fetch_process.prefetch("s3://bucket/run")  # a spawn worker importing the script again
    assert fetch_process._EARLY == {}
