"""GPU health without a GPU: the Xid table and the node's real Xid watch (cloudinit/scripts/
gts-gpu-health.py `watch`) driven by a kernel log file, next to the real trainer launched as the
node's container launches it (training/node/entrypoint.sh). A "replace" Xid ends in a committed
checkpoint and then the group's replace-me call, signed with the node's role credentials
(tests/metadata_server.py), at a local endpoint: moto's Auto Scaling API with a real group and
instance for AWS; fakes in the documented request shapes that check the signature with the
clouds' own SDK code for Alibaba (RPC v1) and Tencent (TC3). A fixed instance is quarantined.

The boot gate is tests/test_gpu_health_gate.py; what the plan grants and renders,
tests/test_gpu_health_plan.py. The elastic side (the other nodes go on at a smaller world size,
a new node joins) is tests/test_elastic.py::test_three_nodes_lose_one_go_on_and_take_it_back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra.resolve import gpu_health
from tests.gpu_health_helpers import (INSTANCE, GROUP, XID79, XID94, ScalingApi, _bucket_env, _committed, _health,
                                      _log, _metadata, _moto_group, _trainer, _watch, _watch_module, _watching)
from tests.harness import ROOT
from tests.training_helpers import LAUNCH_TIMEOUT, RDZV_TEST_KEY, MotoServer, free_port, kill_tree, wait_port


# ---------------------------------------------------------------------------- the table

def test_the_xid_table_has_the_issue_classes_and_sources() -> None:
    doc = gpu_health.load()
    replace, restart, monitor = (set(gpu_health.xid_codes(a)) for a in ("replace", "restart", "monitor"))
    assert {48, 63, 64, 74, 79, 95} <= replace and restart == {13, 31, 43, 94} and monitor == {92}
    assert not (replace & restart or replace & monitor or restart & monitor)
    assert doc["xid"]["unknown"] == "monitor"
    assert all(doc["xid"][a]["sources"] for a in ("replace", "restart", "monitor"))


def test_the_node_reads_the_same_table_and_parses_kernel_lines() -> None:
    health = _watch_module()
    table, unknown, _ = health.load_table(str(ROOT / "infra/data/gpu_health.yaml"))
    for line, code, action in ((XID79, 79, "replace"), (XID94, 94, "restart"),
                               ("NVRM: Xid (PCI:0000:00:1e): 92, pid=1, name=x, High single-bit ECC", 92, "monitor"),
                               ("NVRM: Xid (PCI:0000:00:1e): 4242, pid=1, something new", 4242, "monitor")):
        match = health.XID.search(line)
        assert match and int(match.group("code")) == code
        assert health.classify(table, unknown, code)[0] == action
    assert health.XID.search("usb 1-1: new high-speed USB device number 2") is None


# ---------------------------------------------------------------------------- the runtime watch

def test_xid_79_checkpoints_the_real_trainer_then_the_asg_replaces_the_node(tmp_path: Path) -> None:
    moto = MotoServer()
    ckpt = tmp_path / "ck"
    group, instance = _moto_group(moto)
    meta = _metadata("aws", instance).start()
    api = ScalingApi("aws", meta, at_arrival=lambda: _committed(ckpt), forward=moto.url)
    trainer = _trainer(tmp_path, ckpt)
    watcher = _watch("aws", meta, api, trainer.proc.pid, tmp_path, "--once")
    try:
        _watching(tmp_path, watcher)
        trainer.wait_for(r"step \d+ loss", timeout=LAUNCH_TIMEOUT)
        assert not api.calls and _health(moto, instance) == (group, "Healthy")
        _log(tmp_path, XID79)
        assert api.event.wait(LAUNCH_TIMEOUT), watcher.communicate(timeout=10)[0]
        code = trainer.finish()
        log, _ = watcher.communicate(timeout=LAUNCH_TIMEOUT)
        after = _health(moto, instance)
    finally:
        for proc in (trainer.proc, watcher):
            if proc.poll() is None:
                kill_tree(proc.pid)
        api.stop()
        meta.stop()
        moto.stop()
    assert code == 0, trainer.output[-3000:]
    assert "stopped by SIGTERM" in trainer.output and "emergency checkpoint" in trainer.output
    [call] = api.calls
    # The checkpoint was committed before the node asked to go, and its step is the stop's.
    assert call["at_arrival"] and call["at_arrival"] == _committed(ckpt), (call, _committed(ckpt))
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", trainer.output)
    assert stopped and call["at_arrival"][-1] == f"step-{int(stopped.group(1)):08d}"
    assert call["signature_ok"] and call["signed_by"] == meta.access_key() and call["token"] == "token-0"
    assert call["service"] == "autoscaling"
    assert call["params"] == {"Action": "SetInstanceHealth", "Version": "2011-01-01", "InstanceId": instance,
                              "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": "false"}
    assert after == (group, "Unhealthy")  # moto's real group: this instance, marked
    assert (tmp_path / "run" / "spot-notice").exists()  # the trainer unit is never started again
    metrics = (tmp_path / "tf" / "gts_gpu_watch.prom").read_text()
    assert 'gts_gpu_xid_events_total{action="replace",cloud="aws",group="aws-train",xid="79"} 1' in metrics
    assert 'gts_gpu_replace_requested{cloud="aws",group="aws-train",reason="xid:79"} 1' in metrics
    assert "Xid 79 on PCI:0000:3b:00" in log and "emergency checkpoint: the trainer exited" in log


@pytest.mark.parametrize("cloud", ["alicloud", "tencentcloud"])
def test_xid_79_on_alibaba_and_tencent_calls_the_documented_api_signed_by_the_node(cloud: str, tmp_path: Path) -> None:
    """The stand-in worker (tests/stand_in_worker.py) under the real entrypoint: its 'saved' mark
    is there when the call arrives."""
    from tests.test_cloudinit import _trainer as stand_in, _worker_ready

    marker = tmp_path / "worker"
    meta = _metadata(cloud, INSTANCE[cloud]).start()
    meta.rotate()  # the node signs with the credentials the metadata service gives now
    api = ScalingApi(cloud, meta, at_arrival=lambda: marker.exists() and marker.read_text())
    # Tencent: the scaling-group id comes from the object the plan writes beside the bundle.
    api.objects[f"/gts-bucket/nodes/scaling-groups/{cloud}-train"] = GROUP["tencentcloud"] + "\n"
    launcher = stand_in(marker)
    watcher = _watch(cloud, meta, api, launcher.pid, tmp_path, "--once", env=_bucket_env(api))
    try:
        _worker_ready(marker, launcher)
        _watching(tmp_path, watcher)
        _log(tmp_path, "[ 1.0] NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n" + XID79)
        assert api.event.wait(LAUNCH_TIMEOUT), watcher.communicate(timeout=10)[0]
        assert launcher.wait(timeout=LAUNCH_TIMEOUT) == 0
        watcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        for proc in (launcher, watcher):
            if proc.poll() is None:
                kill_tree(proc.pid)
        api.stop()
        meta.stop()
    call = api.calls[-1] if cloud == "alicloud" else next(c for c in api.calls if c["action"] == "RemoveInstances")
    assert len(api.calls) == (1 if cloud == "alicloud" else 4)
    assert call["at_arrival"] == "saved"
    assert all(c["signature_ok"] and c["signed_by"] == meta.access_key() == f"STS.{cloud}.1" and c["token"] == "token-1"
               for c in api.calls)
    params = call["params"]
    if cloud == "alicloud":
        assert {k: params[k] for k in ("Action", "Version", "InstanceId", "HealthStatus", "RegionId")} == {
            "Action": "SetInstanceHealth", "Version": "2014-08-28", "InstanceId": INSTANCE[cloud],
            "HealthStatus": "Unhealthy", "RegionId": "cn-hangzhou"}
        assert params["SignatureMethod"] == "HMAC-SHA1" and params["SignatureVersion"] == "1.0"
        assert call["group"] == GROUP["alicloud"]
    else:
        assert (call["action"], call["version"]) == ("RemoveInstances", "2018-04-19")
        assert params == {"AutoScalingGroupId": GROUP[cloud], "InstanceIds": [INSTANCE[cloud]]}
        assert [c["action"] for c in api.calls] == ["GetObject", "DescribeAutoScalingGroups", "RemoveInstances",
                                                    "ModifyDesiredCapacity"]
        assert api.calls[0]["service"] == "s3" and api.calls[0]["path"] == "/gts-bucket/nodes/scaling-groups/tencentcloud-train"
        assert api.group["Instances"] == ["ins-other001"] and api.group["DesiredCapacity"] == 2


def test_xid_94_restarts_the_workers_and_replaces_nothing(tmp_path: Path) -> None:
    """An elastic node (the multi-node path, min 1): killing its workers makes torchrun restart
    them, and they resume from the newest committed checkpoint; the node stays."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "training.node.rdzv_store", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "ck"
    meta = _metadata("aws", "i-0123456789abcdef0").start()
    api = ScalingApi("aws", meta)
    trainer = watcher = None
    try:
        wait_port(port)
        trainer = _trainer(tmp_path, ckpt, NNODES="2", MIN_NNODES="1", RDZV_ENDPOINT=f"127.0.0.1:{port}",
                           RDZV_LAST_CALL_S="1", GTS_NODE_GROUP="local",
                           RDZV_KEY=RDZV_TEST_KEY)
        watcher = _watch("aws", meta, api, trainer.proc.pid, tmp_path)
        _watching(tmp_path, watcher)
        trainer.wait_for(r"checkpoint step 20:", timeout=LAUNCH_TIMEOUT)
        _log(tmp_path, XID94)
        resumed = trainer.wait_for(r"resumed from step \d+", timeout=LAUNCH_TIMEOUT)
        assert int(resumed.split("resumed from step ")[1].split()[0]) >= 20
        trainer.wait_for(r"step \d+ loss", timeout=LAUNCH_TIMEOUT)
        assert trainer.proc.poll() is None and watcher.poll() is None  # the node goes on
    finally:
        for proc in (trainer.proc if trainer else None, watcher, store):
            if proc is not None and proc.poll() is None:
                kill_tree(proc.pid)
        api.stop()
        meta.stop()
    assert not api.calls and not (tmp_path / "run" / "spot-notice").exists()
    assert len(re.findall(r"rank 0 of 1 ", trainer.output)) >= 2  # the workers started twice
    metrics = (tmp_path / "tf" / "gts_gpu_watch.prom").read_text()
    assert 'gts_gpu_xid_events_total{action="restart",cloud="aws",group="aws-train",xid="94"} 1' in metrics
    assert "gts_gpu_replace_requested" not in metrics


# ---------------------------------------------------------------------------- fixed instances

def test_a_fixed_node_checkpoints_and_is_quarantined_not_replaced(tmp_path: Path) -> None:
    """GTS_REPLACE=none (reserved groups on Alibaba and Tencent are fixed instances): a replace-class
    Xid still stops the trainer after its checkpoint and keeps it from starting again; no scaling
    API is called; the journal and a metric say the node is quarantined for the operator."""
    from tests.test_cloudinit import _trainer as stand_in, _worker_ready

    marker = tmp_path / "worker"
    meta = _metadata("alicloud", INSTANCE["alicloud"]).start()
    api = ScalingApi("alicloud", meta)
    launcher = stand_in(marker)
    watcher = _watch("alicloud", meta, api, launcher.pid, tmp_path, "--once", env={"GTS_REPLACE": "none"})
    try:
        _worker_ready(marker, launcher)
        _watching(tmp_path, watcher)
        _log(tmp_path, XID79)
        assert launcher.wait(timeout=LAUNCH_TIMEOUT) == 0
        log, _ = watcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        for proc in (launcher, watcher):
            if proc.poll() is None:
                kill_tree(proc.pid)
        api.stop()
        meta.stop()
    assert marker.read_text() == "saved" and not api.calls
    assert (tmp_path / "run" / "spot-notice").exists()
    assert "no scaling group" in log and "quarantined" in log
    metrics = (tmp_path / "tf" / "gts_gpu_watch.prom").read_text()
    assert 'gts_gpu_quarantined{cloud="alicloud",group="alicloud-train",why="no_scaling_group"} 1' in metrics
    assert "gts_gpu_replace_requested" not in metrics
