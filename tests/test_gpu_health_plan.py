"""GPU health in the plan: each node role may replace only its own group, the GPU health alerts
read series the node writes (and promtool accepts them), only groups without a scaling group
render GTS_REPLACE=none, the DCGM diag level is a group field, and on Kubernetes the Job runs the
node gate as its first init container (run here as the pod would run it) and the clouds' own
node repair is on for GPU pools."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.gpu_health_helpers import SCRIPT, _fake_tools, _watch_module
from tests.harness import ROOT
from tests.training_helpers import LAUNCH_TIMEOUT


# ---------------------------------------------------------------------------- the plan's permissions

def _statements(document: str) -> list[dict[str, Any]]:
    doc = json.loads(document)
    return list(doc.get("Statement") or doc.get("statement") or [])


def test_each_node_role_may_replace_only_its_own_group_and_nothing_else() -> None:
    """Over the planned resources: one policy per scaling group, one statement, one action, the
    group's own ARN / id as the resource, attached to that group's node role; no other policy in
    the plan grants one of these actions."""
    from tests.harness import by_type, shipped

    health = _watch_module()
    res = list(shipped("prod"))
    found: dict[str, tuple[str, str, str]] = {}  # group -> (action, resource, role)
    for r in by_type(res, "aws:iam/rolePolicy:RolePolicy"):
        if r.name.endswith("-replace-self"):
            [s] = _statements(r.inputs["policy"])
            found[r.name.removesuffix("-replace-self")] = (s["Action"], s["Resource"], r.inputs["role"])
    attached = {r.name: r.inputs for r in by_type(res, "alicloud:ram/rolePolicyAttachment:RolePolicyAttachment")}
    for r in by_type(res, "alicloud:ram/policy:Policy"):
        if r.name.endswith("-replace-self"):
            [s] = _statements(r.inputs["policyDocument"])
            assert attached[r.name]["policyName"] == r.inputs["policyName"]
            found[r.name.removeprefix("prod-").removesuffix("-replace-self")] = (
                s["Action"], s["Resource"], attached[r.name]["roleName"])
    cam = {r.name: r.inputs for r in by_type(res, "tencentcloud:Cam/rolePolicyAttachment:RolePolicyAttachment")}
    for r in by_type(res, "tencentcloud:Cam/policy:Policy"):
        if r.name.endswith("-replace-self"):
            [s] = _statements(r.inputs["document"])
            [resource] = s["resource"]
            found[r.name.removeprefix("prod-").removesuffix("-replace-self")] = (
                ",".join(s["action"]), resource, cam[r.name]["roleId"])
    asgs = [r.name.removesuffix("-asg") for r in by_type(res, "aws:autoscaling/group:Group") if not r.name.startswith(("aws-eks", "eks"))
            and r.name.endswith("-asg")]
    ess = [r.name.removesuffix("-ess") for r in by_type(res, "alicloud:ess/scalingGroup:ScalingGroup")]
    tas = [r.name.removesuffix("-asg") for r in by_type(res, "tencentcloud:As/scalingGroup:ScalingGroup")]
    assert sorted(found) == sorted(asgs + ess + tas) and len(found) == 3, (found, asgs, ess, tas)
    from infra.plan.invokes import COMPUTED

    (asg,) = [r for r in by_type(res, "aws:autoscaling/group:Group") if r.name == "aws-train-asg"]
    arn = COMPUTED["aws:autoscaling/group:Group"](asg.name, asg.inputs)["arn"]  # what the engine answered
    assert found["aws-train"] == ("autoscaling:SetInstanceHealth", arn, "prod-aws-train-node")
    assert ":autoScalingGroupName/" in found["aws-train"][1]  # its own group's ARN, nothing wider
    assert found["ali-train"][:2] == ("ess:SetInstanceHealth", "acs:ess:cn-hangzhou:*:scalinggroup/ali-train-ess-id")
    assert "prod-ali-train-node" in str(found["ali-train"][2])
    # Tencent: the call, and reading / setting back the desired capacity, on its own group only.
    # CAM's action prefix `name/` and AS's resource type `auto-scaling-group` in its owner's
    # account (issue 41: `autoscalinggroup` names no resource type, so the node was refused).
    uin = "100000000001"  # the mock engine's Tencent account (infra/clouds/tencentcloud/mocks.py)
    assert found["tc-train"][:2] == (
        "name/as:DescribeAutoScalingGroups,name/as:RemoveInstances,name/as:ModifyDesiredCapacity",
        f"qcs::as:ap-guangzhou:uin/{uin}:auto-scaling-group/tc-train-asg-id")
    # The group's nodes learn its id from the object the plan writes once the group exists, under
    # the prefix their role reads already (no new grant).
    [obj] = [r for r in by_type(res, "tencentcloud:Cos/bucketObject:BucketObject") if r.name == "prod-tc-train-group-id"]
    assert obj.inputs["content"] == "tc-train-asg-id" and obj.inputs["key"] == "nodes/scaling-groups/tc-train"
    from infra.buckets import NODES_PREFIX
    assert obj.inputs["key"].startswith(NODES_PREFIX) and health.cloudmeta.cloud_node("tencentcloud").group_id_key("tc-train") == obj.inputs["key"]
    # Nothing else grants these actions (nor a wildcard over the scaling services).
    for r in res:
        text = json.dumps(r.inputs)
        if "replace-self" in r.name or r.type == "kubernetes:core/v1:ConfigMap" and r.name.endswith("-gpu-gate"):
            continue  # the grants themselves; the gate script's own text (a Job's init container)
        for action in ("SetInstanceHealth", "RemoveInstances", "ModifyDesiredCapacity", "autoscaling:*", "ess:*", "as:*"):
            assert action not in text, f"{r.name} ({r.type}) mentions {action}"


def test_the_gpu_health_alerts_read_series_the_node_writes_and_promtool_accepts_them(tmp_path: Path) -> None:
    from infra import monitoring
    from infra.stack.stackfile import load_stack_spec
    from tests.test_monitoring import promtool

    text = monitoring.render(load_stack_spec("prod"))
    (tmp_path / "rules.yml").write_text(text)
    done = subprocess.run([promtool(), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    used = set(re.findall(r"\bgts_gpu_[a-z_]+", text))
    written = SCRIPT.read_text()
    assert {"gts_gpu_gate_ok", "gts_gpu_xid_events_total", "gts_gpu_replace_requested"} <= used
    assert all(f"{name}{{" in written or f'"{name}' in written or f"{name} " in written for name in used), used
    # The exporter gets the counters file that turns the ECC, row-remap, Xid and NVLink counters on.
    csv = (ROOT / "cloudinit/dcgm-counters.csv").read_text()
    for field in ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_XID_ERRORS",
                  "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"):
        assert re.search(rf"^{field}, (counter|gauge), ", csv, re.M), field
    assert "-f /etc/dcgm-exporter/gts-counters.csv" in (ROOT / "cloudinit/units/gts-exporters.service").read_text()


def test_only_groups_without_a_scaling_group_render_replace_none() -> None:
    from infra import userdata
    from infra.resolve import gpu_health as gh
    from infra.resolve.groups import resolve
    from infra.stack.stackfile import load_stack_spec

    stack = resolve(load_stack_spec("prod"))
    for rg in stack.groups:  # prod: every reserved VM group on Alibaba and Tencent is fixed instances
        fixed = rg.kind == "vm" and rg.market.type == "reserved" and rg.cloud in ("alicloud", "tencentcloud")
        assert gh.replace_mode(rg) == ("none" if fixed else "group"), rg.name
    vm = next(g for g in stack.groups if g.kind == "vm")
    reserved = vm.group.model_copy(update={"market": vm.group.market.model_copy(update={"type": "reserved"}),
                                           "cloud": "tencentcloud"})
    ctx = userdata.node_context(stack.spec, replace(vm, group=reserved), "img")
    assert ctx.replace == "none" and "GTS_REPLACE=none" in userdata.render_env(ctx).splitlines()
    assert "GTS_REPLACE" not in userdata.render_env(userdata.node_context(stack.spec, vm, "img"))


# ---------------------------------------------------------------------------- the DCGM level

def test_the_diag_level_is_a_group_field_rendered_only_when_not_the_default() -> None:
    from pydantic import ValidationError

    from infra import userdata
    from infra.model.spec import GpuHealth
    from infra.resolve import gpu_health as gh
    from infra.resolve.groups import resolve
    from infra.stack.stackfile import load_stack_spec

    stack = resolve(load_stack_spec("prod"))
    vm = next(g for g in stack.groups if g.kind == "vm")
    assert vm.group.gpu_health.diag_level == 1 and not gh.advisories(stack.groups)
    slow = replace(vm, group=vm.group.model_copy(update={"gpu_health": GpuHealth(diag_level=2)}))
    assert "GTS_GPU_DIAG_LEVEL=2" in userdata.render_env(userdata.node_context(stack.spec, slow, "img")).splitlines()
    [advice] = gh.advisories([slow])
    assert advice["enforcement"] == "advisory" and "dcgmi diag -r 2" in advice["message"]
    assert "2.5 to 10.5" in advice["message"] and "minutes" in advice["message"]
    assert "2.5 to 10.5 minutes" in (GpuHealth.model_fields["diag_level"].description or "")
    with pytest.raises(ValidationError):
        GpuHealth.model_validate({"diagLevel": 3})


# ---------------------------------------------------------------------------- Kubernetes

def test_the_job_runs_the_node_gate_as_its_first_init_container_and_a_bad_gpu_fails_the_pod(tmp_path: Path) -> None:
    """The planned Job's init container, run as the pod would run it: the ConfigMap's scripts in
    its folder, its command and its env (plain values) with fake nvidia-smi. A GPU missing fails
    it with the reason in its last lines (the termination message); all GPUs pass it."""
    from tests.harness import by_type, shipped

    res = list(shipped("prod"))
    jobs = {r.name: r for r in by_type(res, "kubernetes:batch/v1:Job")}
    maps = {r.name: r for r in by_type(res, "kubernetes:core/v1:ConfigMap")}
    assert jobs and all(j.inputs["spec"]["template"]["spec"]["initContainers"][0]["name"] == "gpu-gate"
                        for j in jobs.values())
    job = jobs["aws-eks-train-job"]
    pod = job.inputs["spec"]["template"]["spec"]
    gate = pod["initContainers"][0]
    trainer = pod["containers"][0]
    assert gate["resources"]["limits"]["nvidia.com/gpu"] == trainer["resources"]["limits"]["nvidia.com/gpu"]
    assert gate["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert gate["securityContext"]["runAsNonRoot"] and not gate["securityContext"]["allowPrivilegeEscalation"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "gpu-gate"]
    folder = tmp_path / "gate"
    folder.mkdir()
    for name, text in maps[volume["configMap"]["name"]].inputs["data"].items():
        (folder / name).write_text(text)
    env = {e["name"]: e["value"] for e in gate["env"] if "value" in e}
    gpus = int(env["GTS_GPU_COUNT"])
    assert env["GTS_GPU_DIAG_LEVEL"] == "0" and env["GTS_NVSWITCH"] == "false"  # not checkable from a pod
    command = [sys.executable if c == "python" else c.replace("/opt/gts/gpu-gate", str(folder)) for c in gate["command"]]
    command = [c.replace("/tmp/gts-run", str(tmp_path / "run")) for c in command]
    for count, want in ((gpus - 1, 1), (gpus, 0)):
        (tmp_path / f"n{count}").mkdir()
        tools = _fake_tools(tmp_path / f"n{count}", gpus=count, links=int(env["GTS_NVLINKS"]) or 12)
        done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                              env={**os.environ, **env, "GTS_LIB": str(ROOT / "training"),
                                   "PATH": f"{tools}:{os.environ['PATH']}"})
        assert done.returncode == want, done.stderr
        calls = (tmp_path / f"n{count}" / "calls").read_text()
        assert "dcgmi" not in calls and "systemctl" not in calls and "nvidia-smi -pm" not in calls
        if want:
            last = done.stderr.strip().splitlines()[-1]
            assert "GPU gate FAILED" in last and f"nvidia-smi sees {count} GPUs, the type has {gpus}" in last


def test_the_clouds_own_node_repair_is_on_for_gpu_pools() -> None:
    """EKS: node_repair_config on every GPU managed node group and the node monitoring agent
    add-on; ACK: a managed GPU pool with auto repair and the two add-ons it needs (pulumi_aws /
    pulumi_alicloud arguments, infra/data/provider_checks.yaml)."""
    from tests.harness import by_type, shipped

    res = list(shipped("prod"))
    groups = {r.name: r.inputs for r in by_type(res, "aws:eks/nodeGroup:NodeGroup")}
    gpu = [n for n, i in groups.items() if i["amiType"].endswith("NVIDIA")]
    assert gpu and all(groups[n]["nodeRepairConfig"] == {"enabled": True} for n in gpu)
    assert all("nodeRepairConfig" not in i for n, i in groups.items() if n not in gpu)
    assert {r.inputs["addonName"] for r in by_type(res, "aws:eks/addon:Addon")} >= {"eks-node-monitoring-agent"}
    pools = {r.name: r.inputs for r in by_type(res, "alicloud:cs/nodePool:NodePool")}
    gpu_pools = [n for n, i in pools.items() if i.get("taints")]
    assert gpu_pools and all(pools[n]["management"] == {"enable": True, "autoRepair": True,
                                                         "autoRepairPolicy": {"restartNode": True}} for n in gpu_pools)
    assert {r.inputs["name"] for r in by_type(res, "alicloud:cs/kubernetesAddon:KubernetesAddon")} == {
        "ack-node-problem-detector", "node-lifecycle-controller"}
