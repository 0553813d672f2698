"""A rank that hangs inside a multi-node run is found by the node's watchdog, not after the
process group's 10-minute timeout: three local "nodes" (the image's entrypoint each, one store,
one S3 bucket on 127.0.0.1, as tests/test_elastic.py runs them); one node's worker is stopped
(SIGSTOP) mid-run, so every other rank waits in its next collective. The watchdogs save every
rank's stacks to the bucket (the stopped rank's naming its frame), stop the workers, the
launchers restart them from the newest checkpoint, the run finishes, and the report shows the
hang as badput naming the rank and node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.training_helpers import ROOT, MotoServer, Run, elastic_node, kill_tree, rendezvous_store, wait_any
from training.node.watchdog import _state  # the watchdog's own reading of a process's state

STEPS = 160


def _node(index: int, port: int, moto: MotoServer, tmp: Path, boot: str) -> Run:
    # GTS_BOOT_TIME: this host booted hours ago; the "node" boots when its test starts
    return elastic_node(tmp, index, port, moto, ["--workload", "tiny", "--checkpoint-every", "20", "--log-every", "10",
                                                 "--throttle-ms", "60"],
                        NNODES="3", MIN_NNODES="3", NPROC_PER_NODE="1", RDZV_LAST_CALL_S="3", HANG_TIMEOUT_S="10",
                        GTS_NODE_NAME=f"node{index}", GTS_PROGRESS_DIR=str(tmp / f"progress{index}"),
                        GTS_TEAM="vision", NODE_HOURLY_USD="2.5", GTS_RUN_ID="hang-run", GTS_BOOT_TIME=boot,
                        CHECKPOINT_URL=f"s3://{moto.bucket}/hang/", TRAIN_STEPS=str(STEPS))


def _worker(progress: Path, after: int) -> tuple[int, int]:
    """(global rank, pid) of the node's running worker, from a heartbeat past step `after` (on a
    loaded machine the agents may have restarted their workers: an older beat names a dead one)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for beat in progress.glob("rank-[0-9]*"):
            fields = beat.read_text().split() if beat.is_file() else []
            running = len(fields) > 4 and _state(int(fields[4])) in ("R", "S", "D")
            if beat.suffix == "" and running and int(fields[0]) > after:
                return int(beat.name.split("-")[1]), int(fields[4])
        time.sleep(0.2)
    raise AssertionError(f"no running worker's heartbeat past step {after} in {progress}")


def test_a_stopped_rank_is_found_its_stacks_saved_and_the_run_resumes(tmp_path: Path) -> None:
    moto = MotoServer()
    nodes: list[Run] = []
    for i in range(3):
        (tmp_path / f"progress{i}").mkdir(mode=0o700)
    with rendezvous_store() as port:
        try:
            boot = f"{time.time():.0f}"
            nodes = [_node(i, port, moto, tmp_path, boot) for i in range(3)]
            wait_any(nodes, r"checkpoint step 40:", timeout=180)
            rank, pid = _worker(tmp_path / "progress2", 40)
            os.kill(pid, signal.SIGSTOP)  # inside or before its next collective: the others wait there
            stopped = time.monotonic() + 30
            while _state(pid) not in ("T", "t") and time.monotonic() < stopped:  # the signal lands
                time.sleep(0.1)
            assert _state(pid) in ("T", "t"), _state(pid)  # really stopped (a live worker, not a stale pid)
            _, line = wait_any([nodes[2]], r"hang: no step on ranks", timeout=120)
            assert f"suspect rank {rank} (stopped)" in line, line
            wait_any(nodes, r"resumed from step \d+", timeout=180)
            for run in nodes:
                assert run.finish(timeout=400) == 0, run.output[-3000:]
            finals = [x for run in nodes for x in run.lines if x.startswith("final step=")]
            assert len(finals) == 1 and finals[0].startswith(f"final step={STEPS} "), finals
            hangs = [k for k in moto.keys("hang/records/hangs/")]
            ours = [k for k in hangs if k.startswith("hang/records/hangs/node2-")]
            assert ours, hangs
            text = moto.client().get_object(Bucket=moto.bucket, Key=ours[0])["Body"].read().decode()
            assert f"suspect rank {rank} (stopped)" in text
            section = text.split(f"== rank {rank} ")[1]
            assert 'File "' in section and "training/trainer/" in section, section[:2000]
        finally:
            for run in nodes:
                if run.proc.poll() is None:
                    kill_tree(run.proc.pid)
        report = subprocess.run([sys.executable, "-m", "training.goodput", "report", "--records",
                                 f"s3://{moto.bucket}/hang/", "--format", "json"], cwd=ROOT, capture_output=True,
                                text=True, timeout=120,
                                env={**os.environ, "STORAGE_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "testing",
                                     "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
        moto.stop()
    assert report.returncode == 0, report.stderr
    run = json.loads(report.stdout)["runs"]["hang-run"]
    assert run["team"] == "vision" and run["badput_hours"]["hang"] > 0
    assert any(f"rank {rank}" in h and "node2" in h for h in run["hangs"]), run["hangs"]
    print("report:", run["hangs"], f"ETTR {run['ettr']:.3f}", run["badput_hours"])  # the figures, with -s
    assert 0 < run["ettr"] < 1 and run["finished"]


WORKER = """
import faulthandler, os, sys, time
from training.records import STACKS_SIGNAL, proc_start
folder, rank = sys.argv[1], sys.argv[2]
faulthandler.register(STACKS_SIGNAL, file=open(f"{folder}/stacks-rank{rank}.txt", "a"), all_threads=True)
def train_step():
    time.sleep(0.05)
step = 0
while True:
    train_step()
    step += 1
    with open(f"{folder}/.rank-{rank}.tmp", "w") as fh:
        fh.write(f"{step} {time.time()} 0.05 {step - step % 10} {os.getpid()} node-x 0 {proc_start(os.getpid())}")
    os.replace(f"{folder}/.rank-{rank}.tmp", f"{folder}/rank-{rank}")
"""


def test_a_node_that_hangs_twice_asks_for_its_replacement(tmp_path: Path) -> None:
    """The watchdog as the entrypoint runs it, over a stand-in worker that heartbeats like the
    trainer: stopped once, it is killed and nothing is replaced; stopped again (a new worker, as
    the launcher restarts it), the node asks its group for its replacement (Alibaba's
    SetInstanceHealth, signed with the instance role, tests/gpu_health_helpers.py's endpoint)."""
    from tests.gpu_health_helpers import INSTANCE, ScalingApi, _metadata
    from tests.training_helpers import retry_until
    from training import records

    progress, ckpt = tmp_path / "progress", tmp_path / "ck"
    progress.mkdir(mode=0o700)
    meta = _metadata("alicloud", INSTANCE["alicloud"]).start()
    api = ScalingApi("alicloud", meta)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GTS_PROGRESS_DIR": str(progress), "CHECKPOINT_DIR": str(ckpt),
           "HANG_TIMEOUT_S": "1", "GTS_CLOUD": "alicloud", "GTS_METADATA_URL": meta.url, "GTS_REPLACE_API_URL": api.url,
           "GTS_NODE_NAME": "node-x", "GTS_NODE_GROUP": "ali-train", "GTS_RUN_ID": "twice",
           "GTS_REPLACEMENTS_PER_HOUR": "0"}  # no group budget here: tests/test_replace_budget.py has it
    dog = subprocess.Popen([sys.executable, "-m", "training.node.watchdog", "--parent", str(os.getpid())], env=env,
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for attempt in (1, 2):
            worker = subprocess.Popen([sys.executable, "-c", WORKER, str(progress), "0"], env=env, cwd=ROOT)
            assert retry_until(lambda: (progress / "rank-0").exists() and
                               (progress / "rank-0").read_text().split()[4] == str(worker.pid), 60)
            os.kill(worker.pid, signal.SIGSTOP)
            assert worker.wait(timeout=60) == -signal.SIGKILL
            if attempt == 1:
                assert not api.calls
        assert api.event.wait(timeout=60)
    finally:
        dog.kill()
        out, _ = dog.communicate(timeout=30)
        api.stop()
        meta.stop()
    assert [c["params"]["Action"] for c in api.calls] == ["SetInstanceHealth"], api.calls
    assert "asking for this node's replacement: 2 hangs on this node" in out, out
    assert retry_until(lambda: len([e for e in records.read(str(ckpt)) if e.kind == "failure"]) == 2 and
                       len(list((ckpt / "records" / "hangs").iterdir())) == 2, 30)  # written in threads
    hangs = [e for e in records.read(str(ckpt)) if e.kind == "failure"]
    assert [(e.failure, e.rank, e.detail.split(":")[0]) for e in hangs] == [("hang", 0, "suspect")] * 2
    stacks = sorted((ckpt / "records" / "hangs").iterdir())
    # the frame each stopped worker was in (its training step, or the heartbeat after it)
    assert len(stacks) == 2 and all('File "<string>", line ' in p.read_text() for p in stacks), stacks[0].read_text()


def _watchdog(progress: Path, ckpt: Path, **env: str) -> subprocess.Popen[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "GTS_PROGRESS_DIR": str(progress), "CHECKPOINT_DIR": str(ckpt),
            "HANG_TIMEOUT_S": "1", "GTS_NODE_NAME": "node-x", "GTS_RUN_ID": "busy", **env}
    return subprocess.Popen([sys.executable, "-m", "training.node.watchdog", "--parent", str(os.getpid())], env=full,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_slow_final_checkpoint_and_upload_is_no_hang(tmp_path: Path) -> None:
    """The real trainer whose last checkpoint's commit is slow (tests/faults.py), watched with a
    1-second floor: the ranks say "busy until" before the save and before finish(), so the
    watchdog leaves them alone, the run finishes and records its end."""
    from tests.training_helpers import launch
    from training import records

    progress, ckpt = tmp_path / "progress", tmp_path / "ck"
    progress.mkdir(mode=0o700)
    dog = _watchdog(progress, ckpt)
    try:
        run = launch(["--workload", "tiny", "--steps", "30", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                      "1000"], tmp_path, {"GTS_PROGRESS_DIR": str(progress), "GTS_RUN_ID": "busy",
                                          "GTS_TEST_SLOW_COMMIT_S": "8", "GTS_TEST_SLOW_COMMIT_STEP": "30"})
        assert run.finish() == 0, run.output[-3000:]
        assert run.final()[0] == 30
    finally:
        dog.kill()
        out, _ = dog.communicate(timeout=30)
    assert "hang:" not in out, out
    assert [e.step for e in records.read(str(ckpt)) if e.kind == "run_finished"] == [30]


def test_the_watchdog_stands_down_while_the_entrypoint_stops(tmp_path: Path) -> None:
    """`stopping` in the progress folder (the entrypoint's TERM / INT: emergency checkpoints and
    uploads follow): the watchdog exits without touching the workers, even a silent one."""
    from tests.training_helpers import retry_until

    progress, ckpt = tmp_path / "progress", tmp_path / "ck"
    progress.mkdir(mode=0o700)
    dog = _watchdog(progress, ckpt)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(progress), "0"], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert retry_until(lambda: (progress / "rank-0").exists(), 60)
        (progress / "stopping").touch()
        os.kill(worker.pid, signal.SIGSTOP)  # silent from now on, as a rank writing its emergency checkpoint
        assert dog.wait(timeout=120) == 0
        assert worker.poll() is None
    finally:
        dog.kill()
        worker.kill()
        worker.wait(timeout=30)
    out = dog.communicate(timeout=30)[0]
    assert "entrypoint is stopping" in out and "hang:" not in out, out


def test_an_unreachable_bucket_does_not_hold_the_restart(tmp_path: Path) -> None:
    """The bucket's endpoint takes connections and never answers: the silent worker is killed
    all the same (while the bucket still has not answered), its stacks kept in the progress folder."""
    import socket

    from tests.training_helpers import retry_until, storage_env

    progress = tmp_path / "progress"
    progress.mkdir(mode=0o700)
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
        endpoint = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
        dog = _watchdog(progress, tmp_path / "unused", CHECKPOINT_URL="s3://bucket/run/", **storage_env(endpoint))
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(progress), "0"], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert retry_until(lambda: (progress / "rank-0").exists(), 60)
            os.kill(worker.pid, signal.SIGSTOP)
            assert worker.wait(timeout=60) == -signal.SIGKILL
            kept = list((progress / "hangs").glob("node-x-*.txt"))
            assert len(kept) == 1 and 'File "<string>", line ' in kept[0].read_text()
        finally:
            dog.kill()
            worker.kill()
            dog.communicate(timeout=30)


def test_a_stale_heartbeat_never_gets_an_unrelated_process_signalled(tmp_path: Path) -> None:
    """Heartbeats left behind (an earlier container's, a pid since reused) name an unrelated
    `sleep`: one with its true start time but not below the launcher, one below it with another
    start time. Both are old enough to be a hang; the watchdog removes them and signals nothing."""
    from tests.training_helpers import retry_until
    from training.records import proc_start

    progress = tmp_path / "progress"
    progress.mkdir(mode=0o700)
    launcher = subprocess.Popen(["sleep", "600"])  # the watched launcher: it has no workers
    unrelated = subprocess.Popen(["sleep", "600"])  # this test's child, below --parent but not the launcher
    old = time.time() - 3600
    (progress / "rank-0").write_text(f"5 {old} 0.05 0 {unrelated.pid} node-x 0 {proc_start(unrelated.pid)}\n")
    full = {**os.environ, "PYTHONPATH": str(ROOT), "GTS_PROGRESS_DIR": str(progress), "HANG_TIMEOUT_S": "1",
            "CHECKPOINT_DIR": str(tmp_path / "ck"), "GTS_NODE_NAME": "node-x", "GTS_RUN_ID": "stale"}
    dog = subprocess.Popen([sys.executable, "-m", "training.node.watchdog", "--parent", str(os.getpid()),
                            "--launcher", str(launcher.pid)], env=full, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        assert retry_until(lambda: not (progress / "rank-0").exists(), 60)
        (progress / "rank-1").write_text(f"5 {old} 0.05 0 {unrelated.pid} node-x 0 {proc_start(launcher.pid)}\n")
        assert retry_until(lambda: not (progress / "rank-1").exists(), 60)
        assert unrelated.poll() is None and _state(unrelated.pid) == "S"
    finally:
        dog.kill()
        for proc in (launcher, unrelated):
            proc.kill()
            proc.wait(timeout=30)
    out = dog.communicate(timeout=30)[0]
    assert "hang:" not in out, out


def test_a_progress_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    progress.mkdir()
    progress.chmod(0o777)
    done = subprocess.run([sys.executable, "-m", "training.node.watchdog", "--progress-dir", str(progress)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"watchdog: GTS_PROGRESS_DIR='{progress}' has mode 0o777; the watchdog signals "
                                   "the pids named there, so it must be a folder of this user's alone: chmod 700 it "
                                   "or leave GTS_PROGRESS_DIR unset")


HANGER = WORKER.replace("    train_step()\n", "    train_step()\n    if step == 3:\n        time.sleep(600)\n")
LAUNCHER = """
import signal, subprocess, sys
child = None
def stop(*_):
    child.kill()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
while True:  # restarts its worker whenever it dies, as torchrun's --max-restarts
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], "0"])
    child.wait()
"""


def test_a_hang_every_restart_meets_again_stops_the_restarts(tmp_path: Path) -> None:
    """A worker that hangs at the same step every time it is restarted: after HANG_RESTARTS (3)
    hangs with no step past it, the watchdog stops the launcher instead of restarting again, says
    so in one line and records it — in the bucket before the launcher is stopped (the node's run
    ends with the launcher: a record still in flight then would be lost)."""
    from training import records

    progress, ckpt = tmp_path / "progress", tmp_path / "ck"
    progress.mkdir(mode=0o700)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, HANGER, str(progress)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    full = {**os.environ, "PYTHONPATH": str(ROOT), "GTS_PROGRESS_DIR": str(progress), "HANG_TIMEOUT_S": "1",
            "CHECKPOINT_DIR": str(ckpt), "GTS_NODE_NAME": "node-x", "GTS_RUN_ID": "again", "HANG_REPLACE": "false"}
    dog = subprocess.Popen([sys.executable, "-m", "training.node.watchdog", "--parent", str(os.getpid()),
                            "--launcher", str(launcher.pid)], env=full, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        assert launcher.wait(timeout=180) == 1
        hangs = [e for e in records.read(str(ckpt)) if e.kind == "failure"]  # read before the dog is stopped
    finally:
        launcher.kill()
        dog.kill()
    out = dog.communicate(timeout=30)[0]
    gave_up = [line for line in out.splitlines() if "hangs in a row" in line]
    assert len(gave_up) == 1 and "3 hangs in a row with no step past 3 between them (HANG_RESTARTS=3)" in gave_up[0]
    assert [e.detail.endswith("not restarted") for e in hangs] == [False, False, True]


def test_the_watchdogs_replacement_takes_a_slot_of_the_group_budget(tmp_path: Path) -> None:
    """A persistent straggler's request with the group's replacement budget on
    (GTS_REPLACEMENTS_PER_HOUR) and no run bucket to keep it in: as the GPU watch does, the node
    is not replaced (fail safe), and the group's API is never called."""
    from tests.gpu_health_helpers import INSTANCE, ScalingApi, _metadata
    from tests.training_helpers import Run

    progress = tmp_path / "progress"
    progress.mkdir(mode=0o700)
    (progress / "replace-request").write_text("straggler: rank 0 slow for 3 windows at step 150\n")
    meta = _metadata("alicloud", INSTANCE["alicloud"]).start()
    api = ScalingApi("alicloud", meta)
    dog = Run(_watchdog(progress, tmp_path / "ck", GTS_CLOUD="alicloud", GTS_METADATA_URL=meta.url,
                        GTS_REPLACE_API_URL=api.url, GTS_NODE_GROUP="ali-train", GTS_REPLACEMENTS_PER_HOUR="2"))
    dog.start_reader()
    try:
        line = dog.wait_for(r"NOT replaced", timeout=60)
    finally:
        dog.proc.kill()
        dog.finish(timeout=30)
        api.stop()
        meta.stop()
    assert "the group's replacement budget could not be read" in line and "no run bucket" in line, line
    assert not api.calls


def test_a_heartbeat_being_written_is_never_removed_under_the_trainer(tmp_path: Path) -> None:
    """The watchdog's scan and a trainer's heartbeat write meet: the file being written (and renamed
    next) is neither matched nor removed, where a `rank-0.tmp` was removed as unreadable and the
    trainer's rename then crashed it (FileNotFoundError, seen on a loaded 3-node run)."""
    from training.node.watchdog import beats
    from training.trainer.progress import Progress

    progress = tmp_path / "progress"
    progress.mkdir(mode=0o700)
    written: list[str] = []
    real_replace = os.replace

    def scan_then_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        written.append(Path(src).name)
        assert beats(progress, os.getpid()) == []  # the scan comes between the write and the rename
        real_replace(src, dst)

    tracker: Any = Progress.__new__(Progress)  # only what a heartbeat reads
    tracker.dir, tracker.comm, tracker.times, tracker.blocked = progress, SimpleNamespace(rank=0), [0.1], 0.0
    tracker.step, tracker.saved, tracker.started = 7, 0, 0
    os_replace, os.replace = os.replace, scan_then_replace  # type: ignore[assignment]
    try:
        tracker._beat(time.time())
    finally:
        os.replace = os_replace
    assert written and (progress / "rank-0").read_text().split()[0] == "7"
    (progress / "rank-0.tmp").write_text("5 ")  # an older trainer's name for it, mid-write
    (progress / "rank-1").write_text("garbage")  # a heartbeat's name, unreadable: removed as before
    beats(progress, os.getpid())
    assert (progress / "rank-0.tmp").exists() and not (progress / "rank-1").exists()
