"""Issue 44's fetch process and the run's lease and listing: for global rank 0 the process
`prefetch` started before torch takes the bucket's lease for its caller before it lists anything,
and hands the lease and its listing over, so that the training process opens no store before its
first step (it does so for its first upload, lease renewal or close). Tested against moto with
real processes: the lease named for the caller and renewed by it, a second run refused naming it,
a lease for a URL no Checkpointer uses given back, an early fetch made with other settings not
used, the listing's warnings said here once, a lease another process of the run took over
kept at a release, and a lease line that is not this run's taking (unknown, refused, another
run's) never adopted."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_fetch_process import WAIT_S, _fast_resume, two_steps
from tests.training_helpers import ROOT, MotoServer
from training.ckpt import fetch_place, fetch_process, storage
from training.ckpt.fetch_process import FetchProcess
from training.ckpt.lease import LEASE_NAME, Lease, LeaseHeld, take

_RESUME = """
import json, sys, threading
from training.ckpt import fetch_place, fetch_process, storage
url, disk = sys.argv[1], sys.argv[2]
fetch_process.prefetch(url)
users, fs = set(), storage.Location.fs
storage.Location.fs = property(lambda self: (users.add(threading.current_thread().name), fs.fget(self))[1])
import torch
from torch import nn
from training.ckpt.checkpointer import Checkpointer
ckpt = Checkpointer(url=url, local_dir=disk)
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
model = model.to_empty(device="cpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
step = ckpt.track(model=model, optimizer=opt).resume(assign=True)
model(torch.randn(4, 8)).sum().backward()
opt.step()
print(f"resumed step {step}; the store used here by", json.dumps(sorted(users)), flush=True)
sys.stdin.readline()
ckpt.close()
print("closed", flush=True)
"""


@pytest.fixture
def url(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield from two_steps(moto, tmp_path, monkeypatch)


def _lease(moto: MotoServer, url: str) -> dict[str, object] | None:
    key = f"{url.split('/', 3)[3]}/{LEASE_NAME}"
    if key not in moto.keys(key):
        return None
    body = json.loads(moto.client().get_object(Bucket=moto.bucket, Key=key)["Body"].read())
    assert isinstance(body, dict)
    return body


def test_the_early_fetch_takes_the_lease_for_its_caller_which_renews_it_and_opens_no_store_first(
        url: str, moto: MotoServer, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GTS_LEASE_TTL_S": "40"}  # renewed every 10 s
    start = [sys.executable, "-c", textwrap.dedent(_RESUME), url]
    first = subprocess.Popen([*start, str(tmp_path / "a")], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdin is not None
        assert select.select([first.stdout], [], [], WAIT_S)[0], "the script said nothing"  # (a bound, not a figure)
        line = first.stdout.readline()
        assert line.startswith("resumed step 2; "), line or (first.stderr and first.stderr.read())
        assert set(json.loads(line.split(" by ", 1)[1])) <= {"checkpoint-lease"}, line  # its renewals only, if any yet
        body = _lease(moto, url)
        assert body is not None and body["run"] == f"process {first.pid} on {os.uname().nodename}", body
        assert f"(pid {first.pid} on " in str(body["holder"]), body  # the caller's, not its fetch process's
        deadline = time.monotonic() + WAIT_S  # until the caller renews it (an event; the bound only guards a hang)
        while (now := _lease(moto, url)) is None or now["renewed"] == body["renewed"]:
            assert time.monotonic() < deadline, "the caller never renewed the lease its fetch process took for it"
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            time.sleep(0.1)
        assert now["holder"] == body["holder"], now
        second = subprocess.run([*start, str(tmp_path / "b")], cwd=tmp_path, env=env, input="\n",
                                capture_output=True, text=True, timeout=WAIT_S)
        assert second.returncode == 2 and second.stderr.startswith(
            f"refused: {url} is in use by process {first.pid} on "), second.stdout + second.stderr
        assert "Traceback" not in second.stderr and "resumed" not in second.stdout
        first.stdin.write("\n")
        first.stdin.flush()
        assert select.select([first.stdout], [], [], WAIT_S)[0] and first.stdout.readline().strip() == "closed"
        assert first.wait(timeout=WAIT_S) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _lease(moto, url) is None  # given back at the close


def test_a_lease_taken_for_a_url_no_checkpointer_uses_is_given_back(
        url: str, moto: MotoServer, tmp_path: Path) -> None:
    other = url + "-other"
    assert fetch_process.prefetch(other)
    assert fetch_process._EARLY[other].lease_line()["lease"] == "held" and _lease(moto, other) is not None
    ckpt, _, step = _fast_resume(url, tmp_path / "disk")
    try:
        assert step == 2 and fetch_process._EARLY == {}
        assert _lease(moto, other) is None  # dropped with its lease
        assert _lease(moto, url) is not None
    finally:
        ckpt.close()


def test_the_fetch_process_listing_s_warnings_are_said_here_once(
        url: str, moto: MotoServer, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1's manifest in the bucket is damaged: the fetch process (which logs nothing) lists
    around it and hands over step 2 with its listing; the training process says what it found."""
    caplog.set_level(logging.INFO, logger="gts.checkpoint")
    monkeypatch.setenv("GTS_LEASE_TTL_S", "3600")  # no renewal opens the store during the test
    key = f"{url.split('/', 3)[3]}/step-00000001/manifest-node000.json"
    moto.client().put_object(Bucket=moto.bucket, Key=key, Body=b"{not json")
    assert fetch_process.prefetch(url)
    ckpt, _, step = _fast_resume(url, tmp_path / "disk")
    try:
        fetcher = ckpt.manager.loader.prefetched.fetcher
        assert step == 2 and isinstance(fetcher, FetchProcess)
        assert f"(into memory, by fetch process {fetcher.pid}:" in caplog.text
        said = [r.getMessage() for r in caplog.records if "skipping checkpoint step 1" in r.getMessage()]
        assert len(said) == 1 and f"{url}/step-00000001/manifest-node000.json is damaged: not JSON" in said[0], said
        assert ckpt.manager.remote is not None and not ckpt.manager.remote.opened  # listed by the fetch process alone
    finally:
        ckpt.close()


def test_a_dropped_fetch_gives_back_its_own_taking_of_the_lease_only(url: str, moto: MotoServer) -> None:
    assert fetch_process.prefetch(url)
    said = fetch_process._EARLY[url].lease_line()
    assert said["lease"] == "held"
    since = Lease(storage.location(url), str(said["run"]))  # the same run took it over since (a restart)
    since.acquire()
    fetch_process.drop(url)
    body = _lease(moto, url)
    assert body is not None and body["token"] == since.token, body
    since.release()
    assert _lease(moto, url) is None


def test_a_second_start_of_a_live_run_gives_nothing_back_and_the_run_keeps_its_lease(
        url: str, moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process of the run trains (its lease renewed); a second start of the same run on this
    node takes the lease over in its fetch process, then fails before its Checkpointer (the node's
    run lock): the lease is not deleted, and the training process renews it as its own."""
    monkeypatch.setenv("GTS_RUN_ID", "live")
    live = Lease(storage.location(url), "run live", pid=1)
    live.acquire()
    assert fetch_process.prefetch(url)
    said = fetch_process._EARLY[url].lease_line()
    assert said["lease"] == "held" and said["shared"] is True, said
    fetch_process.drop(url)
    assert _lease(moto, url) is not None
    assert live.renew()
    body = _lease(moto, url)
    assert body is not None and body["holder"] == live.holder and body["token"] == live.token
    live.release()
    assert _lease(moto, url) is None


def test_a_process_forked_from_the_caller_leaves_the_fetch_s_lease_alone(url: str, moto: MotoServer) -> None:
    """A worker forked after `prefetch` that ends through the interpreter's exit (its atexit)."""
    assert fetch_process.prefetch(url)
    assert fetch_process._EARLY[url].lease_line()["lease"] == "held"
    pid = os.fork()
    if pid == 0:
        try:
            fetch_process.drop()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert _lease(moto, url) is not None and fetch_process.early(url)
    fetch_process.drop()
    assert _lease(moto, url) is None


def test_a_lease_deleted_under_its_holder_is_written_again_at_its_renewal(tmp_path: Path) -> None:
    """Deleted (another process of the run gave back its own taking): not taken by another run."""
    where = storage.location(f"file://{tmp_path / 'bucket'}")
    lease = Lease(where, "run one")
    lease.acquire()
    (tmp_path / "bucket" / LEASE_NAME).unlink()
    assert lease.renew() and not lease.lost
    assert json.loads((tmp_path / "bucket" / LEASE_NAME).read_text())["token"] == lease.token


def test_a_release_keeps_a_lease_another_taking_of_the_run_made_since(tmp_path: Path) -> None:
    """The same process and run, two takings (an early fetch's, then the manager's own): giving
    the first back leaves the second."""
    where = storage.location(f"file://{tmp_path / 'bucket'}")
    first, second = Lease(where, "run one"), Lease(where, "run one")
    first.acquire()
    second.acquire()
    first.release()
    assert json.loads((tmp_path / "bucket" / LEASE_NAME).read_text())["token"] == second.token


@pytest.mark.parametrize("taken_over, expires", [(False, None), (True, None), (False, "soon")])
def test_a_handed_lease_half_expired_is_renewed_at_once_or_refused_when_taken_over(
        tmp_path: Path, taken_over: bool, expires: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch process took the lease long before the Checkpointer was made (heavy work in
    between): the manager renews it before anything else, and a run that took it over meanwhile
    (it had expired) refuses this one."""
    where = storage.location(f"file://{tmp_path / 'bucket'}")
    env = {"GTS_RUN_ID": "mine"}
    child = Lease(where, "run mine", ttl_s=120, clock=lambda: time.time() - 100)  # written 100 s ago
    child.acquire()
    path = tmp_path / "bucket" / LEASE_NAME
    if taken_over:  # (as Lease.acquire takes over an expired lease)
        other = Lease(where, "run other")
        current = other.store.read()
        assert current is not None
        other.store.replace(other._body(), current[1])
    monkeypatch.delenv("GTS_LEASE_TTL_S", raising=False)
    handed = {"lease": "held", "run": "run mine", "token": child.token, "expires": expires or child.expires}
    if taken_over:
        with pytest.raises(LeaseHeld, match="the run lease was taken by run other"):
            take(where, lambda why: None, env=env, handed=handed)
        return
    lease = take(where, lambda why: None, env=env, handed=handed)
    try:
        body = json.loads(path.read_text())
        assert body["expires"] > child.expires + 50 and body["token"] == child.token  # renewed now, the same taking
    finally:
        lease.release()
    assert not path.exists()


_FAILS_FIRST = """
import sys
from training.ckpt import fetch_process
assert fetch_process.prefetch(sys.argv[1]) and fetch_process._EARLY[sys.argv[1]].lease_line()["lease"] == "held"
raise SystemExit("the script fails before its Checkpointer")
"""


def test_a_start_that_fails_before_its_checkpointer_gives_the_lease_back(url: str, moto: MotoServer,
                                                                         tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_FAILS_FIRST), url], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=WAIT_S)
    assert run.returncode == 1 and "fails before its Checkpointer" in run.stderr, run.stdout + run.stderr
    assert _lease(moto, url) is None  # an immediate rerun is not refused by its dead predecessor


def test_only_global_rank_0_s_fetch_takes_the_lease() -> None:
    zero = {"rank": 0}
    assert fetch_place.leases(zero, {}) and fetch_place.leases(zero, {"RANK": "0", "MASTER_ADDR": "10.0.0.1"})
    assert not fetch_place.leases({"rank": 3}, {"RANK": "3"})
    for hint in ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE"):  # RANK not set yet: a launcher sets it later
        assert not fetch_place.leases(zero, {hint: "2"}), hint
    assert fetch_place.leases(zero, {"WORLD_SIZE": "1"})  # a one-process script that says so


def test_a_store_whose_library_is_missing_is_said_when_the_location_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The filesystem is made at its first use; a missing s3fs is still said at once, naming the fix."""
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else found(name, *a))
    with pytest.raises(ValueError, match=r"s3://b/x: s3fs is not installed; install the trainer's requirements"):
        storage.location("s3://b/x")
    assert storage.location("file:///tmp/x").remote is False


def test_a_release_keeps_a_lease_another_process_of_the_run_took_over(tmp_path: Path) -> None:
    where = storage.location(f"file://{tmp_path / 'bucket'}")
    old = Lease(where, "run one", pid=1001)
    old.acquire()
    new = Lease(where, "run one", pid=1002)  # a replacement of the same run takes it at once
    new.acquire()
    old.release()  # the old holder's late clean stop
    body = json.loads((tmp_path / "bucket" / LEASE_NAME).read_text())
    assert "(pid 1002 on " in body["holder"], body
    new.release()
    assert not (tmp_path / "bucket" / LEASE_NAME).exists()


def test_an_early_fetch_started_with_other_settings_is_dropped_and_its_lease_given_back(
        url: str, moto: MotoServer, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's settings changed between `prefetch` and the Checkpointer (another endpoint or
    credentials: what the early process read may be another store's): its files are not used,
    the lease it took for this process is given back, and the manager takes its own."""
    caplog.set_level(logging.DEBUG, logger="gts.checkpoint")
    assert fetch_process.prefetch(url)
    early = fetch_process._EARLY[url]
    assert early.lease_line()["lease"] == "held"
    lease_key = f"{url.split('/', 3)[3]}/run.lease"
    body = json.loads(moto.client().get_object(Bucket=moto.bucket, Key=lease_key)["Body"].read())
    assert body["token"] == early.lease_line()["token"]
    assert body["holder"].startswith(f"process {os.getpid()} on ") and f"(pid {os.getpid()} on " in body["holder"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")
    monkeypatch.setenv("GTS_RUN_ID", "named-since")  # the run's identity too: not refused by its own early lease
    ckpt, _, step = _fast_resume(url, tmp_path / "disk")
    try:
        assert step == 2 and early.proc.poll() is not None
        fetcher = ckpt.manager.loader.prefetched.fetcher
        assert isinstance(fetcher, FetchProcess) and fetcher.pid != early.pid
        assert f"(into memory, by fetch process {fetcher.pid}:" in caplog.text
        assert f"by fetch process {early.pid}" not in caplog.text
        lease = ckpt.manager.lease
        assert lease is not None and lease.held
        body = _lease(moto, url)  # the manager's own taking, not deleted with the early process's
        assert body is not None and body["token"] == lease.token and body["run"] == "run named-since", body
    finally:
        ckpt.close()
    assert lease_key not in moto.keys(url.split("/", 3)[3])  # given back at the close



@pytest.mark.parametrize("said", ["unknown", "refused", "held by another run"])
def test_a_lease_line_that_is_not_this_run_s_taking_is_never_adopted(tmp_path: Path, said: str) -> None:
    """The fetch process could not reach the store for the lease (unknown), met a holder that
    has since given it back (refused), or said it holds the lease of another run: the manager asks
    the store itself. The first two take it now, as this run; the third is refused while that run
    holds it, never made its holder."""
    where = storage.location(f"file://{tmp_path / 'bucket'}")
    path = tmp_path / "bucket" / LEASE_NAME
    other = Lease(where, "run other")
    other.acquire()
    handed: dict[str, object] = {"lease": said.split()[0], "why": "OSError: the store did not answer"}
    if said == "held by another run":
        handed.update(run="run other", token=other.token, expires=other.expires)
        with pytest.raises(LeaseHeld, match="run other"):
            take(where, lambda why: None, env={"GTS_RUN_ID": "mine"}, handed=handed)
        assert json.loads(path.read_text())["token"] == other.token
        return
    other.release()  # (the refusal's holder ended meanwhile; an unknown line never saw it)
    lease = take(where, lambda why: None, env={"GTS_RUN_ID": "mine"}, handed=handed)
    try:
        body = json.loads(path.read_text())
        assert lease.held and body["run"] == "run mine" and body["token"] == lease.token != other.token
    finally:
        lease.release()
    assert not path.exists()
