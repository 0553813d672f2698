"""The bucket a run checkpoints to, guarded: a bucket deleted while the run trains stops it
with the URL and the store's answer (its steps kept on the node, and where); a second run on
the same prefix is refused naming the holder, while the same run restarted (a clean stop, a
replacement node of its group) resumes. Run as a user would run their own loop, through the
image's entrypoint with gloo processes, against moto on 127.0.0.1."""

from __future__ import annotations

import http.server
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_user_code import start
from tests.training_helpers import ROOT, MotoServer, Run, kill_tree, storage_env
from training import contract
from training.ckpt import storage
from training.ckpt.manager import run_key
from training.ckpt.lease import LEASE_NAME, Conflict, Lease, LeaseHeld, run_identity

EXAMPLE = ROOT / "examples" / "plain_loop.py"
ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]
ENDLESS = 100_000  # steps: the run never ends by itself within a test


def node_env(tmp_path: Path, url: str, endpoint: str, scratch: str = "node", nproc: int = 2,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    command = [str(EXAMPLE), "--steps", str(ENDLESS), "--sleep-ms", "20"]
    return {contract.TRAIN_COMMAND.name: contract.encode_command(command), contract.NPROC_PER_NODE.name: str(nproc),
            contract.CHECKPOINT_DIR.name: str(tmp_path / scratch), contract.CHECKPOINT_URL.name: url,
            contract.CHECKPOINT_EVERY.name: "5", **storage_env(endpoint), **(extra or {})}


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def delete_bucket(moto: MotoServer) -> None:
    """Empty it and delete it (again when the run's next upload landed in between)."""
    from botocore.exceptions import ClientError

    client = moto.client()
    for _ in range(20):
        for key in moto.keys():
            client.delete_object(Bucket=moto.bucket, Key=key)
        try:
            client.delete_bucket(Bucket=moto.bucket)
            return
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "BucketNotEmpty":
                raise
    raise AssertionError("the bucket never stayed empty long enough to be deleted")


def test_a_bucket_deleted_mid_run_stops_it_with_the_url_the_cause_and_the_kept_steps(moto: MotoServer,
                                                                                    tmp_path: Path) -> None:
    url = f"s3://{moto.bucket}/lost"
    run = start(ENTRYPOINT, node_env(tmp_path, url, moto.url), tmp_path)
    run.wait_for(r"uploaded step-00000010 to s3://")
    delete_bucket(moto)
    assert run.finish() == 2, run.output[-3000:]
    line = last_line(run.output)
    folder = tmp_path / "node" / run_key(url)
    assert line.startswith(f"entrypoint: stopped: checkpoint storage {url}: NoSuchBucket: "), line
    assert f"its checkpoints are kept on this node in {folder} (" in line, line
    kept = line.split(f"{folder} (")[1].split(")")[0].split(", ")
    assert kept and all((folder / name / "manifest-node000.json").is_file() for name in kept), kept
    assert "final step=" not in run.output  # the loop left; the user's own success line never ran
    assert "Traceback" not in run.output and "Exception in thread" not in run.output, run.output[-4000:]
    stopped = int(run.wait_for(r"stopping at step \d+").split("stopping at step ")[1])
    assert stopped < ENDLESS and f"step-{stopped:08d}" in kept  # the step it stopped at is kept too
    moto.client().create_bucket(Bucket=moto.bucket)  # the module's other tests share the server


# ------------------------------------------------------------------ one run per prefix

def test_a_second_run_on_the_same_prefix_is_refused_naming_the_holder(moto: MotoServer, tmp_path: Path) -> None:
    url = f"s3://{moto.bucket}/shared"
    runs: list[Run] = []
    try:
        first = start(ENTRYPOINT, node_env(tmp_path, url, moto.url, "node-a"), tmp_path)
        runs.append(first)
        first.wait_for(r"uploaded step-00000005 to s3://")
        second = start(ENTRYPOINT, node_env(tmp_path, url, moto.url, "node-b"), tmp_path)  # its own disk, same prefix
        runs.append(second)
        assert second.finish() == 2, second.output[-3000:]
        line = last_line(second.output)
        assert line.startswith(f"entrypoint: refused: {url} is in use by torchrun run "), line
        assert "another run writes this checkpoint prefix" in line and "(pid " in line, line
        assert "Traceback" not in second.output, second.output[-3000:]
        assert not list((tmp_path / "node-b").glob("*/step-*")), "the refused run wrote nothing"
        assert first.proc.poll() is None, "the holder trains on"

        os.kill(first.proc.pid, signal.SIGTERM)  # a clean stop gives the lease back ...
        assert first.finish() == 0, first.output[-3000:]
        assert f"shared/{LEASE_NAME}" not in moto.keys("shared/")
        stopped = int(first.wait_for(r"stopped by SIGTERM at step \d+").split("at step ")[1].split()[0])
        kept = sorted(key for key in moto.keys("shared/") if "manifest" in key)
        assert any(f"step-{stopped:08d}/" in key for key in kept), (stopped, kept, checkpoint_lines(first))
        again = start(ENTRYPOINT, node_env(tmp_path, url, moto.url, "node-b"), tmp_path)  # ... so its restart resumes
        runs.append(again)
        resumed = again.wait_for(r"resumed from checkpoint step \d+|skipping checkpoint step")
        assert resumed.endswith(f"resumed from checkpoint step {stopped}"), (
            resumed, kept, checkpoint_lines(first), checkpoint_lines(again))
        os.kill(again.proc.pid, signal.SIGTERM)
        assert again.finish() == 0, again.output[-3000:]
    finally:  # a failed assertion leaves no run training on for the rest of the suite
        for run in runs:
            kill_tree(run.proc.pid)


def checkpoint_lines(run: Run) -> str:
    """What a run said about its steps (saves, uploads, resumes, stops), not its loss lines."""
    words = ("checkpoint", "uploaded", "committed", "stopp", "fetched", "resum", "skipp", "damaged")
    return "\n".join(line for line in run.lines if any(word in line for word in words))[-4000:]


def test_a_replacement_node_of_the_same_run_takes_the_lease_at_once(moto: MotoServer, tmp_path: Path) -> None:
    """A node SIGKILLed (no clean stop: the lease stays, good for minutes) and a replacement
    of the same node group on a new disk: the same run, so it takes the lease and resumes."""
    url = f"s3://{moto.bucket}/group"
    group = {"GTS_NODE_GROUP": "trainers"}
    lost = start(ENTRYPOINT, node_env(tmp_path, url, moto.url, "node-a", nproc=1, extra=group), tmp_path)
    lost.wait_for(r"uploaded step-00000010 to s3://")
    kill_tree(lost.proc.pid)
    lost.finish()
    assert f"group/{LEASE_NAME}" in moto.keys("group/")
    replacement = start(ENTRYPOINT, node_env(tmp_path, url, moto.url, "node-b", nproc=1, extra=group), tmp_path)
    replacement.wait_for(r"resumed from checkpoint step (1\d|[2-9]\d)\b")
    os.kill(replacement.proc.pid, signal.SIGTERM)
    assert replacement.finish() == 0, replacement.output[-3000:]


class Clock:
    """A clock the test moves (no sleeps)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["s3", "file"])
def prefix(request: pytest.FixtureRequest, moto: MotoServer, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path / 'bucket'}"
        return
    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    yield f"s3://{moto.bucket}/lease-{tmp_path.name}"


def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it_lost(prefix: str) -> None:
    clock = Clock()
    first = Lease(storage.location(prefix), "run one", ttl_s=60, clock=clock)
    first.acquire()
    second = Lease(storage.location(prefix), "run two", ttl_s=60, clock=clock)
    clock.now += 59  # not yet expired: refused, the holder named
    with pytest.raises(LeaseHeld, match=r"is in use by run one \(pid \d+ on .*good for 1 s more"):
        second.acquire()
    assert first.renew()  # renewed: good for 60 s from now
    clock.now += 59
    with pytest.raises(LeaseHeld):
        second.acquire()
    clock.now += 2  # the holder died without renewing: expired
    second.acquire()
    assert not first.renew() and "taken by run two" in first.lost
    assert second.renew()
    second.release()
    third = Lease(storage.location(prefix), "run three", ttl_s=60, clock=clock)
    third.acquire()  # given back: taken at once


def test_the_same_run_takes_its_own_lease_back_and_only_one_creator_wins(prefix: str) -> None:
    clock = Clock()
    Lease(storage.location(prefix), "node group trainers", ttl_s=60, clock=clock).acquire()
    Lease(storage.location(prefix), "node group trainers", ttl_s=60, clock=clock).acquire()  # a replacement node
    store = Lease(storage.location(prefix), "x", clock=clock).store
    store.delete()
    store.create({"run": "a"})
    with pytest.raises(Conflict):  # the conditional create: a second creator loses
        store.create({"run": "b"})
    current = store.read()
    assert current is not None and current[0] == {"run": "a"}
    store.replace({"run": "c"}, current[1])
    with pytest.raises(Conflict):  # the conditional replace: a stale ETag loses
        store.replace({"run": "d"}, current[1])


def test_run_identity_prefers_the_given_id_then_the_group_then_torchrun() -> None:
    assert run_identity({"GTS_RUN_ID": "r1", "GTS_NODE_GROUP": "g", "TORCHELASTIC_RUN_ID": "t"}) == "run r1"
    assert run_identity({"GTS_NODE_GROUP": "g", "TORCHELASTIC_RUN_ID": "t"}) == "node group g"
    assert run_identity({"TORCHELASTIC_RUN_ID": "t"}) == "torchrun run t"
    assert run_identity({"TORCHELASTIC_RUN_ID": "none"}).startswith(f"process {os.getpid()} on ")


class Recording(http.server.BaseHTTPRequestHandler):
    """An S3-compatible endpoint that has no objects and keeps the headers of each PUT."""

    protocol_version = "HTTP/1.1"  # answers botocore's Expect: 100-continue
    puts: list[dict[str, str]] = []

    def do_GET(self) -> None:
        body = b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        Recording.puts.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("ETag", '"e"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize("scheme, header", [("oss", "x-oss-forbid-overwrite"), ("cosn", "x-cos-forbid-overwrite")])
def test_oss_and_cos_take_the_lease_with_their_forbid_overwrite_header(scheme: str, header: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for key, value in storage_env(f"http://127.0.0.1:{server.server_address[1]}").items():
            monkeypatch.setenv(key, value)
        Recording.puts.clear()
        Lease(storage.location(f"{scheme}://bucket/run"), "run one").acquire()
        assert len(Recording.puts) == 1 and Recording.puts[0].get(header) == "true", Recording.puts
        assert "if-none-match" not in Recording.puts[0]
    finally:
        server.shutdown()
