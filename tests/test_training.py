"""The trainer as real processes (torchrun / accelerate, gloo on CPU) against a real S3
endpoint on 127.0.0.1 (moto server): checkpoints, exact resume after SIGTERM, a SIGKILL in the
middle of a checkpoint, resume from the bucket, a storage outage, two accelerate processes."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.system_tools import debian_tool
from tests.training_helpers import MotoServer, Proxy, free_port, kill_tree, launch, retry_until, storage_env

from tests.conftest import TRAIN_ARGS as ARGS


def test_two_rank_run_completes_and_checkpoints(reference: tuple[str, Path]) -> None:
    _, ck = reference
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000020", "step-00000040", "step-00000060"]
    manifest = json.loads((ck / "step-00000060" / "manifest-node000.json").read_text())
    assert manifest["world_size"] == 2 and set(manifest["files"]) == {"model.pt", "rng-rank00000.pt", "rng-rank00001.pt"}
    for name, meta in manifest["files"].items():
        assert (ck / "step-00000060" / name).stat().st_size == meta["size"]


def test_sigterm_then_restart_is_bit_identical(reference: tuple[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: with MLFLOW_TRACKING_URI set, the restarted run continues the same MLflow run."""
    digest, _ = reference
    args = [*ARGS, "--checkpoint-dir", str(tmp_path / "ck")]
    tracking = {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    run = launch([*args, "--throttle-ms", "100"], tmp_path, env=tracking)
    run.wait_for(r"step 35 loss")
    os.kill(run.proc.pid, signal.SIGTERM)  # to torchrun, which forwards it to the workers
    run.finish()  # torchrun exits 1 after a SIGTERM even though the workers exited 0
    line = run.wait_for(r"stopped by SIGTERM at step \d+ after an emergency checkpoint")
    stopped = int(line.split("at step ")[1].split()[0])
    assert 35 <= stopped < 60 and (tmp_path / "ck" / f"step-{stopped:08d}").is_dir()
    again = launch(args, tmp_path, env=tracking)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(rf"resumed from step {stopped} ")
    assert again.final()[2] == digest

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=tracking["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))
    assert steps[0] <= 35 and steps[-1] == 60 and any(s > stopped for s in steps), steps
    assert runs[0].data.params["workload"] == "tiny" and runs[0].info.status == "FINISHED"


def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous_one(
        reference: tuple[str, Path], tmp_path: Path) -> None:
    digest, _ = reference
    args = [*ARGS, "--checkpoint-dir", str(tmp_path / "ck")]
    run = launch(args, tmp_path, env={"GTS_TEST_SLOW_COMMIT_S": "60", "GTS_TEST_SLOW_COMMIT_STEP": "40"})
    run.wait_for(r"fault injection: pausing .* before committing step-00000040")
    kill_tree(run.proc.pid)  # torchrun and its workers (each in a session of its own)
    run.finish()
    assert (tmp_path / "ck" / "step-00000040.tmp").is_dir(), "the kill landed mid-checkpoint"
    again = launch(args, tmp_path)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(r"resumed from step 20 ")
    assert not (tmp_path / "ck" / "step-00000040.tmp").exists()
    assert again.final()[2] == digest


@pytest.mark.parametrize("scheme", ["s3", "oss", "cosn"])
def test_every_storage_scheme_round_trips_through_an_s3_endpoint(moto: MotoServer, scheme: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """oss:// and cosn:// go through the clouds' S3-compatible endpoints; the signing and
    addressing options each scheme sets must still talk to a real S3 server."""
    from training.ckpt import storage

    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    loc = storage.location(f"{scheme}://{moto.bucket}/schemes/{scheme}")
    assert loc.remote
    loc.fs.pipe(loc.join("step-1/a.bin"), b"x" * 1000)
    assert loc.fs.cat(loc.join("step-1/a.bin")) == b"x" * 1000
    assert moto.keys(f"schemes/{scheme}/") == [f"schemes/{scheme}/step-1/a.bin"]


def test_oss_and_cos_urls_use_their_regional_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    from training.ckpt import storage

    monkeypatch.delenv("STORAGE_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("STORAGE_REGION", "cn-hangzhou")
    assert storage.location("oss://b/x").fs.client_kwargs["endpoint_url"] == "https://s3.oss-cn-hangzhou.aliyuncs.com"
    monkeypatch.setenv("STORAGE_REGION", "ap-guangzhou")
    cos = storage.location("cosn://b-1250000000/x")
    assert cos.fs.client_kwargs["endpoint_url"] == "https://cos.ap-guangzhou.myqcloud.com"
    assert cos.root == "b-1250000000/x"
    monkeypatch.delenv("STORAGE_REGION")
    with pytest.raises(ValueError, match="STORAGE_REGION"):
        storage.location("oss://b/x")
    with pytest.raises(ValueError, match="unsupported storage URL 'gs://b'"):
        storage.location("gs://b")


def test_checkpoints_reach_the_bucket_and_resume_from_it(reference: tuple[str, Path], moto: MotoServer,
                                                         tmp_path: Path) -> None:
    digest, _ = reference
    env = storage_env(moto.url)
    args = [*ARGS, "--checkpoint-dir", f"s3://{moto.bucket}/run-d"]
    run = launch([*args, "--throttle-ms", "100"], tmp_path, env)
    run.wait_for(r"uploaded step-00000040 ")
    os.kill(run.proc.pid, signal.SIGTERM)  # a reclaim: the emergency checkpoint goes up too
    run.finish()
    stopped = int(run.wait_for(r"stopped by SIGTERM at step \d+").split("at step ")[1].split()[0])
    keys = moto.keys("run-d/")
    for step in (20, 40, stopped):
        assert f"run-d/step-{step:08d}/manifest-node000.json" in keys
        assert f"run-d/step-{step:08d}/model.pt" in keys
    shutil.rmtree(tmp_path / "out")  # the node's local disk is gone (new spot instance)
    again = launch(args, tmp_path, env)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(rf"fetched step-{stopped:08d} from s3://")
    assert again.final()[2] == digest


def test_storage_outage_does_not_stop_training(moto: MotoServer, tmp_path: Path) -> None:
    proxy = Proxy(moto.port)
    # One run started twice: its lease on the prefix (training/ckpt/lease.py), which the first start
    # could not give back through the outage, is its own (a stack's node gets GTS_NODE_GROUP).
    env = {**storage_env(f"http://127.0.0.1:{proxy.port}"), "GTS_RUN_ID": "outage-run"}
    args = ["--workload", "tiny", "--steps", "60", "--checkpoint-every", "10", "--log-every", "5",
            "--checkpoint-dir", f"s3://{moto.bucket}/run-e", "--upload-deadline-s", "4", "--throttle-ms", "50"]
    port = free_port()
    run = launch([*args, "--metrics-port", str(port)], tmp_path, env)
    run.wait_for(r"uploaded step-00000010")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'gts_train_step{cloud="",group="",node="0",team="",workload="tiny"}' in metrics
    assert "gts_checkpoint_uploads_pending" in metrics and 'gts_node_hourly_usd{' in metrics
    proxy.down()
    assert run.finish() == 0, run.output[-3000:]
    assert run.final()[0] == 60, "training finished through the outage"
    run.wait_for(r"checkpoint\(s\) could not be uploaded .* kept in")
    assert "run-e/step-00000060/manifest-node000.json" not in moto.keys("run-e/")
    proxy.up()  # the store is back: the next start uploads what is missing
    again = launch(args, tmp_path, env)
    assert again.finish() == 0, again.output[-3000:]
    assert retry_until(lambda: "run-e/step-00000060/manifest-node000.json" in moto.keys("run-e/"), 30)
    again.wait_for(r"uploading \d+ checkpoint\(s\) missing from the bucket")
    proxy.down()


def test_accelerate_launch_trains_two_processes_together(reference: tuple[str, Path], tmp_path: Path) -> None:
    digest, _ = reference
    run = launch([*ARGS, "--checkpoint-dir", str(tmp_path / "ck")], tmp_path, accelerate=True)
    assert run.finish() == 0, run.output[-3000:]
    assert "rank 1 of 2 (node 0 of 1) via accelerate" in run.output, "a second process trained with the first"
    manifest = json.loads((tmp_path / "ck" / "step-00000060" / "manifest-node000.json").read_text())
    assert manifest["world_size"] == 2
    # Same seed, same data shards, same gradient averaging as the torchrun run.
    assert run.final()[2] == digest


def test_dataset_cache_is_resumable_and_verified(moto: MotoServer, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import tarfile

    from training.node.datasync import sync

    for key, value in storage_env(moto.url).items():
        monkeypatch.setenv(key, value)
    client = moto.client()
    for name, body in (("a/1.jpg", b"x" * 10), ("a/2.jpg", b"y" * 20), ("b/3.jpg", b"z" * 30)):
        client.put_object(Bucket=moto.bucket, Key=f"data/{name}", Body=body)
    dest = tmp_path / "cache"
    first = sync(f"s3://{moto.bucket}/data", str(dest), workers=4)
    assert (first.copied, first.total, first.sharded) == (3, 3, False)
    assert (dest / "b" / "3.jpg").read_bytes() == b"z" * 30
    assert sync(f"s3://{moto.bucket}/data", str(dest)).copied == 0, "complete files are skipped"
    (dest / "a" / "2.jpg").write_bytes(b"partial")  # an interrupted copy
    assert sync(f"s3://{moto.bucket}/data", str(dest)).copied == 1
    assert (dest / "a" / "2.jpg").read_bytes() == b"y" * 20
    # The same command copies a local dataset into a bucket (one cloud's copy), resumably.
    assert sync(str(dest), f"s3://{moto.bucket}/datasets/copy", workers=4).copied == 3
    assert sync(str(dest), f"s3://{moto.bucket}/datasets/copy").copied == 0
    assert moto.keys("datasets/copy") == ["datasets/copy/a/1.jpg", "datasets/copy/a/2.jpg", "datasets/copy/b/3.jpg"]
    # A sharded dataset: the node fetches the tar shards and unpacks them, once.
    for shard in range(2):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            data = f"shard {shard}".encode()
            info = tarfile.TarInfo(f"class{shard}/img.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        client.put_object(Bucket=moto.bucket, Key=f"sharded/shards/{shard:05d}.tar", Body=raw.getvalue())
    shards = sync(f"s3://{moto.bucket}/sharded", str(tmp_path / "sharded"))
    assert (shards.copied, shards.total, shards.sharded) == (2, 2, True)
    assert (tmp_path / "sharded" / "class1" / "img.jpg").read_bytes() == b"shard 1"
    assert sync(f"s3://{moto.bucket}/sharded", str(tmp_path / "sharded")).copied == 0


def test_resnet50_on_an_image_folder_with_bf16_and_grad_checkpointing(tmp_path: Path) -> None:
    import subprocess
    import sys

    from PIL import Image

    for label, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (80 + 8 * i, 72), colour).save(tmp_path / "images" / label / f"{i}.jpg")
    cmd = [sys.executable, "-m", "training.trainer.train", "--workload", "resnet50", "--data-dir", str(tmp_path / "images"),
           "--image-size", "64", "--batch-size", "2", "--steps", "3", "--checkpoint-every", "2",
           "--precision", "bf16", "--grad-checkpointing", "--checkpoint-dir", str(tmp_path / "ck"), "--log-every", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "final step=3 " in proc.stdout
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-00000002", "step-00000003"]


def _prometheus_query(web_port: int, expr: str) -> list[dict[str, Any]]:
    import json as _json

    url = f"http://127.0.0.1:{web_port}/api/v1/query?query={urllib.parse.quote(expr)}"
    return list(_json.loads(urllib.request.urlopen(url, timeout=2).read())["data"]["result"])


def _scrape_started(web_port: int) -> None:
    """Prometheus has scraped a step from the trainer, and its cost-so-far grows from the node's price."""
    def value(expr: str) -> float:
        try:
            result = _prometheus_query(web_port, expr)
        except OSError:
            return 0.0
        return float(result[0]["value"][1]) if result else 0.0
    assert retry_until(lambda: value("gts_train_step") > 0, 60), "Prometheus never saw gts_train_step"
    assert retry_until(lambda: value("gts_node_cost_usd") > 0, 30), \
        "the cost-so-far metric grows from the node's hourly price"


def _rules_and_dashboard_hold(web_port: int, spec: Any, team: str) -> None:
    """The stack's rules load and evaluate over the live series; showback gives the spend to the
    team; every dashboard query runs, those over the trainer's metrics returning its series."""
    import json as _json

    from infra import monitoring

    query = functools.partial(_prometheus_query, web_port)
    # The budget-pace alert's expression over the live series: one node at 3.06 USD/h.
    assert float(query(monitoring.SPEND_PACE)[0]["value"][1]) == pytest.approx(3.06 * 730)

    def rules_evaluated() -> bool:
        url = f"http://127.0.0.1:{web_port}/api/v1/rules"
        groups = _json.loads(urllib.request.urlopen(url, timeout=2).read())["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) >= 7 and all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("2")
                                       for r in rules)
    assert retry_until(rules_evaluated, 30), "Prometheus did not load and evaluate the stack's rules"
    # Showback: the recording rule gives the node's spend to the team its env names.
    assert team == spec.team_name
    assert retry_until(lambda: bool(query(monitoring.TEAM_NODE_SPEND)), 30), "the showback rule recorded nothing"
    spend = query(monitoring.TEAM_NODE_SPEND)
    assert [r["metric"].get("team") for r in spend] == [spec.team_name]
    assert float(spend[0]["value"][1]) == pytest.approx(3.06 * 730)
    # Every dashboard query runs; those over the trainer's metrics return its series (the spot
    # and GPU-health series come from the node's textfile collector, not the trainer).
    for panel in monitoring.dashboard(spec)["panels"]:
        for target in panel["targets"]:
            series = query(target["expr"])
            if "gts_" in target["expr"] and not any(k in target["expr"] for k in ("gts_spot", "gts_gpu_")):
                assert series, f"dashboard panel {panel['title']!r}: {target['expr']} returned nothing"


def test_a_real_prometheus_scrapes_the_trainer(tmp_path: Path) -> None:
    import subprocess
    import sys

    binary = debian_tool("prometheus", "prometheus")
    metrics_port, web_port = free_port(), free_port()
    from infra import monitoring
    from infra.stack.stackfile import load_stack_spec
    from tests.contract_helpers import vm_env

    spec = load_stack_spec("dev")
    (tmp_path / "rules.yml").write_text(monitoring.render(spec))  # the stack's alerting rules
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\nrule_files: [rules.yml]\n"
        f"scrape_configs: [{{job_name: trainer, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n")
    # The identity a dev AWS node's env file gives its trainer (decoded from the node's user data):
    # the metrics' labels, which the showback rules sum by team.
    node = vm_env("dev", "aws", tmp_path)
    identity = {k: node[k] for k in ("GTS_CLOUD", "GTS_NODE_GROUP", "GTS_TEAM")}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **identity}
    # Steps enough to outlast any load: the trainer is stopped when the checks are done.
    trainer = subprocess.Popen([sys.executable, "-m", "training.trainer.train", "--steps", "1000000",
                                "--throttle-ms", "50", "--checkpoint-every", "100", "--checkpoint-dir",
                                str(tmp_path / "ck"), "--metrics-port", str(metrics_port), "--node-hourly-usd", "3.06"],
                               cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _scrape_started(web_port)
        _rules_and_dashboard_hold(web_port, spec, identity["GTS_TEAM"])
    finally:
        for proc in (trainer, prom):
            proc.terminate()
            proc.wait(timeout=30)


class _RunsCode:
    """A pickle that runs a command when unpickled (what a tampered checkpoint could carry)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_checkpoint_cannot_run_code_when_loaded(tmp_path: Path) -> None:
    import pickle

    import torch

    from training.ckpt.manager import (MODEL_FILE, CheckpointError, CheckpointManager, Topology, manifest_name,
                                     rng_name, sha256_of, step_dir)
    from training.ckpt.checkpointer import rng_state, set_rng_state

    topo = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), None, topo)
    saved_rng = rng_state()
    mgr.save(10, {"step": 10, "weights": torch.ones(3)}, saved_rng, lambda: None)
    model, rng = mgr.load(10)  # the trainer's own states load with weights_only=True
    assert model["step"] == 10 and torch.equal(model["weights"], torch.ones(3))
    assert rng is not None
    set_rng_state(rng)
    assert torch.equal(rng_state()["numpy"]["keys"], saved_rng["numpy"]["keys"])

    folder = tmp_path / "ckpt" / step_dir(10)
    marker = tmp_path / "ran"
    evil = folder / MODEL_FILE
    evil.write_bytes(pickle.dumps({"step": _RunsCode(marker)}))
    manifest = json.loads((folder / manifest_name(0)).read_text())
    # a matching manifest too: only the unpickler stands between the file and the process
    manifest["files"][MODEL_FILE].update(size=evil.stat().st_size, sha256=sha256_of(evil))
    (folder / manifest_name(0)).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model.pt cannot be read as tensors and plain values"):
        mgr.load(10)
    assert not marker.exists()
    assert (folder / rng_name(0)).exists()


def test_a_stopped_run_exits_zero_through_the_entrypoint_and_resumes(reference: tuple[str, Path], tmp_path: Path) -> None:
    """SIGTERM to the image's entrypoint (what docker stop, a pod's termination, the spot watcher
    and `kill` of `make train-local` send): the workers checkpoint, the entrypoint exits 0 with one
    line saying where the run stopped and no traceback; SIGUSR1 checkpoints and goes on."""
    import subprocess

    from tests.training_helpers import BIN, LAUNCH_TIMEOUT, ROOT

    digest, _ = reference
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2", "LAUNCHER": "torchrun"}
    args = [*ARGS, "--checkpoint-dir", str(tmp_path / "ck")]
    proc = subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh"), *args, "--throttle-ms", "100"], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    from tests.training_helpers import Run

    run = Run(proc)
    run.start_reader()
    run.wait_for(r"step 10 loss")
    proc.send_signal(signal.SIGUSR1)
    run.wait_for(r"checkpoint step 1\d: loop blocked")
    run.wait_for(r"step 30 loss")
    proc.send_signal(signal.SIGTERM)
    assert run.finish(LAUNCH_TIMEOUT) == 0, run.output[-3000:]
    stops = [line for line in run.lines if "stopped by" in line]
    assert len(stops) == 1 and re.search(r"rank0 .* stopped by SIGTERM at step \d+ after an emergency checkpoint",
                                         stops[0]), run.output[-2000:]
    assert "Traceback" not in run.output and "SignalException" not in run.output
    again = subprocess.run(["bash", str(ROOT / "training/node/entrypoint.sh"), *args], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert again.returncode == 0 and f"params_sha256={digest}" in again.stdout, again.stderr[-2000:]
