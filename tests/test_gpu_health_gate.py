"""GPU health without a GPU: the node's real boot gate (cloudinit/scripts/gts-gpu-health.py
`gate`) with fake `nvidia-smi` / `dcgmi` / `systemctl`. A healthy node passes; each failing
check keeps the trainer from starting and asks the group for a replacement, signed by the node
(tests/gpu_health_helpers.py ScalingApi); a Tencent node leaves and the group keeps its desired
capacity; bad node.env values are usage errors naming them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.gpu_health_helpers import (GROUP, INSTANCE, SCRIPT, ScalingApi, _bucket_env, _fake_tools, _gate, _metadata,
                                      _watch_module)
from tests.harness import ROOT


# ---------------------------------------------------------------------------- the boot gate


def test_a_healthy_node_passes_its_gate(tmp_path: Path) -> None:
    tools = _fake_tools(tmp_path, gpus=8)
    with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
        api = ScalingApi("alicloud", meta)
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", "--nvswitch", "--nvlinks", "12", "--diag-level", "1")
        api.stop()
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text()
    assert "dcgmi diag -r 1" in calls and "systemctl is-active nvidia-fabricmanager" in calls and "nvlink -s" in calls
    assert not api.calls and not (tmp_path / "run" / "spot-notice").exists()
    assert 'gts_gpu_gate_ok{cloud="alicloud",group="ali-train"} 1' in (tmp_path / "tf" / "gts_gpu_gate.prom").read_text()


@pytest.mark.parametrize("fault,args,check", [
    ({"gpus": 7}, [], "gpu_count"),
    ({"gpus": 8, "diag_rc": 226}, [], "dcgm_diag"),
    ({"gpus": 8, "links": 11}, ["--nvlinks", "12"], "nvlink"),
    ({"gpus": 8, "fabric": "failed"}, ["--nvswitch"], "fabric_manager"),
    ({"gpus": 8, "persistence": "Disabled"}, [], "persistence_mode"),
])
def test_a_failing_gate_keeps_the_trainer_from_starting_and_asks_for_a_replacement(
        fault: dict[str, Any], args: list[str], check: str, tmp_path: Path) -> None:
    tools = _fake_tools(tmp_path, **fault)
    with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
        api = ScalingApi("alicloud", meta)
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", *args)
        api.stop()
    assert done.returncode == 1
    failed = [line for line in done.stderr.splitlines() if "GPU gate FAILED" in line]
    assert len(failed) == 1 and f"{check}:" in failed[0], done.stderr  # one line in the journal
    assert (tmp_path / "run" / "spot-notice").exists()  # gts-trainer.service's condition: never started
    metrics = (tmp_path / "tf" / "gts_gpu_gate.prom").read_text()
    assert 'gts_gpu_gate_ok{cloud="alicloud",group="ali-train"} 0' in metrics
    assert f'gts_gpu_gate_check_ok{{check="{check}",cloud="alicloud",group="ali-train"}} 0' in metrics
    [call] = api.calls
    assert call["signature_ok"] and call["params"]["Action"] == "SetInstanceHealth"
    assert call["params"]["InstanceId"] == INSTANCE["alicloud"] and call["params"]["HealthStatus"] == "Unhealthy"


def test_the_gate_starts_the_hosts_dcgm_engine_before_it_asks_dcgmi(tmp_path: Path) -> None:
    """An image that ships dcgmi without enabling nvidia-dcgm (issue 46): the gate starts the
    service, waits for its engine, and the healthy node passes."""
    tools = _fake_tools(tmp_path, gpus=8, dcgm="stopped")
    with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
        api = ScalingApi("alicloud", meta)
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", "--diag-level", "1")
        api.stop()
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls.index("systemctl start nvidia-dcgm") < calls.index("dcgmi diag -r 1"), calls
    assert not api.calls


def test_a_gate_without_its_tool_keeps_the_trainer_off_but_never_condemns_the_node(tmp_path: Path) -> None:
    """dcgmi on the host, no DCGM host engine anywhere and no way to run the exporter's: the gate
    cannot judge the GPUs. Before, the node asked for its replacement — and every new node the
    same, draining the group; now it stays out (quarantined, for the operator) and asks nothing."""
    tools = _fake_tools(tmp_path, gpus=8, dcgm="absent")
    with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
        api = ScalingApi("alicloud", meta)
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", "--diag-level", "1",
                     env={"PATH": str(tools)})  # no docker: the exporter image's engine cannot run either
        api.stop()
    assert done.returncode == 1
    [line] = [ln for ln in done.stderr.splitlines() if "GPU gate" in ln]
    assert "could not run" in line and "NOT replaced" in line and "dcgm_diag" in line, done.stderr
    assert not api.calls, api.calls
    assert (tmp_path / "run" / "spot-notice").exists()  # the trainer stays off
    metrics = (tmp_path / "tf" / "gts_gpu_gate.prom").read_text()
    assert 'gts_gpu_quarantined{cloud="alicloud",group="ali-train",why="gate_tool:dcgm_diag"} 1' in metrics


def test_the_gate_runs_after_the_host_services_it_asks() -> None:
    unit = (ROOT / "cloudinit/units/gts-gpu-gate.service").read_text()
    after = " ".join(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("After="))
    assert "nvidia-fabricmanager.service" in after.split() and "nvidia-dcgm.service" in after.split()


def test_the_trainer_unit_requires_the_gate_and_the_node_gets_the_types_expectations() -> None:
    from infra import userdata
    from infra.resolve.groups import resolve
    from infra.stack.stackfile import load_stack_spec

    trainer = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    requires = re.search(r"^Requires=(.*)$", trainer, re.M)
    after = re.search(r"^After=(.*)$", trainer, re.M)
    assert requires and "gts-gpu-gate.service" in requires.group(1).split()
    assert after and "gts-gpu-gate.service" in after.group(1).split()
    gate = (ROOT / "cloudinit/units/gts-gpu-gate.service").read_text()
    assert "Type=oneshot" in gate and "RemainAfterExit=yes" in gate and "gts-gpu-health.py gate" in gate
    stack = resolve(load_stack_spec("prod"))
    env = dict(line.split("=", 1) for line in userdata.render_env(
        userdata.node_context(stack.spec, stack.group("aws-train"), "img")).splitlines() if "=" in line and not line.startswith("#"))
    assert env["NPROC_PER_NODE"] == "8" and env["GTS_NVSWITCH"] == "true" and env["GTS_NVLINKS"] == "12"  # p4d: A100 SXM4
    assert "GTS_GPU_DIAG_LEVEL" not in env  # level 1 is the gate's default (user data is tight on Tencent)


# ---------------------------------------------------------------------------- Tencent's desired capacity

@pytest.mark.parametrize("lowers", [True, False], ids=["remove-lowers-desired", "remove-keeps-desired"])
def test_a_tencent_node_that_fails_its_gate_leaves_and_the_group_keeps_its_desired_capacity(
        lowers: bool, tmp_path: Path) -> None:
    """RemoveInstances' documentation does not say what it does to the desired capacity; the
    node reads it first and sets it back, so the group launches a replacement either way."""
    tools = _fake_tools(tmp_path, gpus=7)
    with _metadata("tencentcloud", INSTANCE["tencentcloud"]) as meta:
        api = ScalingApi("tencentcloud", meta, lowers_desired=lowers)
        api.objects["/gts-bucket/nodes/scaling-groups/tc-train"] = GROUP["tencentcloud"]
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", "--group", "tc-train", env=_bucket_env(api))
        api.stop()
    assert done.returncode == 1, done.stderr
    assert [c["action"] for c in api.calls] == ["GetObject", "DescribeAutoScalingGroups", "RemoveInstances",
                                                "ModifyDesiredCapacity"]
    assert all(c["signature_ok"] and c["signed_by"] == meta.access_key() for c in api.calls)
    assert api.calls[-1]["params"] == {"AutoScalingGroupId": GROUP["tencentcloud"], "DesiredCapacity": 2}
    assert api.group["Instances"] == ["ins-other001"] and api.group["DesiredCapacity"] == 2


def test_a_tencent_node_refuses_a_group_id_object_that_is_not_one(tmp_path: Path) -> None:
    """A hostile or broken object never reaches the AS API as a group id."""
    health = _watch_module()
    meta = _metadata("tencentcloud", INSTANCE["tencentcloud"]).start()
    api = ScalingApi("tencentcloud", meta)
    api.objects["/gts-bucket/nodes/scaling-groups/tc-train"] = "asg-x\"}, \"InstanceIds\": [\"ins-all\"]"
    try:
        creds = health.cloudmeta.Metadata("tencentcloud", meta.url).credentials()
        os.environ.update(_bucket_env(api))
        with pytest.raises(ValueError, match="not a scaling-group id"):
            health.cloudmeta.cloud_node("tencentcloud").replace_self(creds, "ap-guangzhou", INSTANCE["tencentcloud"],
                                                                     api.url, "tc-train", "")
    finally:
        for key in _bucket_env(api):
            os.environ.pop(key, None)
        api.stop()
        meta.stop()
    assert [c["action"] for c in api.calls] == ["GetObject"]


@pytest.mark.parametrize("env,named", [
    ({"GTS_GPU_DIAG_LEVEL": "3"}, "GTS_GPU_DIAG_LEVEL"), ({"GTS_GPU_DIAG_LEVEL": "2; reboot"}, "--diag-level"),
    ({"GTS_REPLACE": "grup"}, "GTS_REPLACE"), ({"GTS_GPU_COUNT": "eight"}, "--gpus"),
    ({"GTS_SCALING_GROUP_ID": "asg-1\nGTS_X=1"}, "GTS_SCALING_GROUP_ID")])
def test_node_env_values_the_gate_reads_are_checked_like_its_flags(env: dict[str, str], named: str,
                                                                    tmp_path: Path) -> None:
    """argparse checks choices only on the command line: a bad node.env value must be a usage
    error naming it (exit 2, no traceback), not a level 3 diag, a typo'd mode or a crash."""
    gpus = [] if "GTS_GPU_COUNT" in env else ["--gpus", "8"]  # the count itself from node.env in that case
    proc = subprocess.run([sys.executable, str(SCRIPT), "gate", "--cloud", "tencentcloud", *gpus],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GTS_LIB": str(ROOT / "training"), **env})
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
