"""GPU health without a GPU: the node's real boot gate and Xid watch (cloudinit/scripts/
gts-gpu-health.py) driven by fake `nvidia-smi` / `dcgmi` / `systemctl` and a kernel log file,
next to the real trainer launched as the node's container launches it (training/node/entrypoint.sh).
A "replace" Xid ends in a committed checkpoint and then the group's replace-me call, signed with
the node's role credentials (tests/metadata_server.py), at a local endpoint: moto's Auto Scaling
API with a real group and instance for AWS; fakes in the documented request shapes that check
the signature with the clouds' own SDK code for Alibaba (RPC v1) and Tencent (TC3).

The elastic side (the other nodes go on at a smaller world size, a new node joins) is
tests/test_elastic.py::test_three_nodes_lose_one_go_on_and_take_it_back."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest

from infra import gpu_health
from tests.harness import ROOT
from tests.metadata_server import FakeMetadata
from tests.training_helpers import BIN, LAUNCH_TIMEOUT, RDZV_TEST_KEY, MotoServer, Run, free_port, kill_tree, wait_port

SCRIPT = ROOT / "cloudinit" / "scripts" / "gts-gpu-health.py"
XID79 = "[ 1234.567] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
XID94 = "[ 99.1] NVRM: Xid (PCI:0000:3b:00): 94, pid=4242, name=python, Contained: SM (0x1). RST: No, D-RST: No\n"
INSTANCE = {"aws": "", "alicloud": "i-bp1ap6bro51a7fsa0001", "tencentcloud": "ins-cri8d02t"}
GROUP = {"alicloud": "asg-bp1fdwe2y0z4hle", "tencentcloud": "asg-boz1qhnk"}


# ---------------------------------------------------------------------------- the table

def test_the_xid_table_has_the_issue_classes_and_sources() -> None:
    doc = gpu_health.load()
    replace, restart, monitor = (set(gpu_health.xid_codes(a)) for a in ("replace", "restart", "monitor"))
    assert {48, 63, 64, 74, 79, 95} <= replace and restart == {13, 31, 43, 94} and monitor == {92}
    assert not (replace & restart or replace & monitor or restart & monitor)
    assert doc["xid"]["unknown"] == "monitor"
    assert all(doc["xid"][a]["sources"] for a in ("replace", "restart", "monitor"))


def _watch_module() -> Any:
    sys.path[:0] = [str(ROOT / "training"), str(ROOT / "training" / "node")]  # its `import cloudmeta`, `import node_replace`
    import importlib.util
    spec = importlib.util.spec_from_file_location("gts_gpu_health", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


# ---------------------------------------------------------------------------- fake tools

def _fake_tools(tmp: Path, gpus: int, persistence: str = "Enabled", diag_rc: int = 0, links: int = 12,
                fabric: str = "active") -> Path:
    """nvidia-smi, dcgmi and systemctl as the gate calls them, answering like the real ones."""
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    rows = "\n".join(f"{i}, {persistence}" for i in range(gpus))
    nvlink = "".join(f"GPU {i}: NVIDIA A100-SXM4-40GB (UUID: GPU-{i})\n" +
                     "".join(f"\t Link {j}: 25 GB/s\n" for j in range(links)) for i in range(gpus))
    tools = {
        "nvidia-smi": f"""#!/bin/bash
echo "nvidia-smi $*" >> "{tmp}/calls"
case "$1" in
  --query-gpu=*) printf '%s\\n' "{rows}" ;;
  nvlink) printf '%s' "{nvlink}" ;;
  -pm) exit 0 ;;
esac
""",
        "dcgmi": f"""#!/bin/bash
echo "dcgmi $*" >> "{tmp}/calls"
echo "| Diagnostic                | {'Pass' if diag_rc == 0 else 'Fail - GPU 3'} |"
exit {diag_rc}
""",
        "systemctl": f"""#!/bin/bash
echo "systemctl $*" >> "{tmp}/calls"
echo {fabric}
""",
    }
    for name, body in tools.items():
        path = bin_ / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_


# ---------------------------------------------------------------------------- the clouds' scaling APIs

class ScalingApi:
    """A local endpoint for one cloud's replace-me call. It checks the signature with the cloud's
    own code (botocore SigV4, Alibaba's tea-openapi RPC signature, Tencent's SDK TC3 key chain),
    notes who signed and what was asked, and what `at_arrival()` says when the request came.
    AWS requests then go to moto's real Auto Scaling API."""

    def __init__(self, cloud: str, meta: FakeMetadata, at_arrival: Callable[[], Any] = lambda: None,
                 forward: str = "", lowers_desired: bool = False):
        self.cloud, self.meta, self.at_arrival, self.forward = cloud, meta, at_arrival, forward
        self.calls: list[dict[str, Any]] = []
        # Tencent: one AS group as the API documents it; whether RemoveInstances lowers the
        # desired capacity is not documented, so the fake does either.
        self.group: dict[str, Any] = {"AutoScalingGroupId": GROUP["tencentcloud"], "DesiredCapacity": 2,
                      "Instances": [INSTANCE["tencentcloud"], "ins-other001"]}
        self.lowers_desired = lowers_desired
        self.objects: dict[str, str] = {}  # COS (S3 API, path style): /<bucket>/<key> -> body
        self.event = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                if owner.cloud == "tencentcloud" and self.path in owner.objects:
                    return self.object_get()
                self.handle_call(b"")

            def object_get(self) -> None:
                call = owner.check_sigv4("GET", self.path, {k: v for k, v in self.headers.items()}, b"")
                owner.calls.append({**call, "action": "GetObject", "path": self.path})
                body = owner.objects[self.path].encode() if call["signature_ok"] else b"denied"
                self.send_response(200 if call["signature_ok"] else 403)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                self.handle_call(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def handle_call(self, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items()}
                call = owner.check(self.command, self.path, headers, body)
                call["at_arrival"] = owner.at_arrival()
                owner.calls.append(call)
                status, answer = 200, json.dumps({"RequestId": "r-1"}).encode()
                if owner.forward:  # AWS: moto answers
                    req = urllib.request.Request(owner.forward + self.path, data=body, method=self.command,
                                                 headers={k: v for k, v in headers.items() if k.lower() != "host"})
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        status, answer = resp.status, resp.read()
                elif owner.cloud == "tencentcloud":
                    answer = json.dumps({"Response": {**owner.tencent(call), "RequestId": "r-1"}}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                owner.event.set()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def secret(self) -> str:
        return f"secret-{self.meta.generation}"

    def tencent(self, call: dict[str, Any]) -> dict[str, Any]:
        """The answer of the documented AS API 2018-04-19 for this call, on the one group."""
        group, params = self.group, call["params"]
        if not call["signature_ok"]:
            return {"Error": {"Code": "AuthFailure.SignatureFailure", "Message": "signature"}}
        if call["action"] == "DescribeAutoScalingGroups":
            found = [dict(group, InstanceCount=len(group["Instances"]))] if group["AutoScalingGroupId"] in params[
                "AutoScalingGroupIds"] else []
            return {"AutoScalingGroupSet": found, "TotalCount": len(found)}
        if params.get("AutoScalingGroupId") != group["AutoScalingGroupId"]:
            return {"Error": {"Code": "ResourceNotFound.AutoScalingGroupNotFound", "Message": "no such group"}}
        if call["action"] == "RemoveInstances":
            group["Instances"] = [i for i in group["Instances"] if i not in params["InstanceIds"]]
            if self.lowers_desired:
                group["DesiredCapacity"] -= len(params["InstanceIds"])
            return {"ActivityId": "asa-dne04cxp"}
        if call["action"] == "ModifyDesiredCapacity":
            group["DesiredCapacity"] = params["DesiredCapacity"]
            return {}
        return {"Error": {"Code": "InvalidAction", "Message": call["action"]}}

    def check_sigv4(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        auth = re.match(r"AWS4-HMAC-SHA256 Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request, "
                        r"SignedHeaders=([^,]+), Signature=(\w+)", headers["Authorization"])
        assert auth, headers
        signed = {h: headers[next(k for k in headers if k.lower() == h)] for h in auth.group(4).split(";")}
        req = AWSRequest(method=method, url=self.url + path, data=body, headers=signed)
        req.context["timestamp"] = signed["x-amz-date"]
        signer = SigV4Auth(Credentials(auth.group(1), self.secret(), headers.get("X-Amz-Security-Token")),
                           auth.group(3), auth.group(2))
        if auth.group(3) == "s3":
            req.context["payload_signing_enabled"] = True
        good = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req) == auth.group(5)
        return {"signed_by": auth.group(1), "signature_ok": good, "service": auth.group(3),
                "token": headers.get("X-Amz-Security-Token")}

    def check(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        if self.cloud == "aws":
            from botocore.auth import SigV4Auth
            from botocore.awsrequest import AWSRequest
            from botocore.credentials import Credentials

            auth = re.match(r"AWS4-HMAC-SHA256 Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request, "
                            r"SignedHeaders=([^,]+), Signature=(\w+)", headers["Authorization"])
            assert auth, headers
            signed = {h: headers[next(k for k in headers if k.lower() == h)] for h in auth.group(4).split(";")}
            req = AWSRequest(method=method, url=self.url + path, data=body, headers=signed)
            req.context["timestamp"] = signed["x-amz-date"]
            signer = SigV4Auth(Credentials(auth.group(1), self.secret(), headers.get("X-Amz-Security-Token")),
                               auth.group(3), auth.group(2))
            good = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req) == auth.group(5)
            form = dict(urllib.parse.parse_qsl(body.decode()))
            return {"signed_by": auth.group(1), "signature_ok": good, "service": auth.group(3),
                    "token": headers.get("X-Amz-Security-Token"), "params": form}
        if self.cloud == "alicloud":
            from alibabacloud_tea_openapi.utils import Utils

            query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query))
            signature = query.pop("Signature")
            good = Utils.get_rpcsignature(query, method, self.secret()) == signature
            return {"signed_by": query["AccessKeyId"], "signature_ok": good, "token": query.get("SecurityToken"),
                    "params": query, "group": GROUP["alicloud"] if query.get("InstanceId") == INSTANCE["alicloud"] else None}
        from tencentcloud.common.sign import Sign

        auth = re.match(r"TC3-HMAC-SHA256 Credential=([^/]+)/(\d{4}-\d\d-\d\d)/(\w+)/tc3_request, "
                        r"SignedHeaders=([^,]+), Signature=(\w+)", headers["Authorization"])
        assert auth, headers
        import hashlib
        names = auth.group(4).split(";")
        lookup = {k.lower(): v for k, v in headers.items()}
        canonical = "\n".join([method, "/", "", "".join(f"{n}:{lookup[n]}\n" for n in names), auth.group(4),
                               hashlib.sha256(body).hexdigest()])
        to_sign = "\n".join(["TC3-HMAC-SHA256", lookup["x-tc-timestamp"], f"{auth.group(2)}/{auth.group(3)}/tc3_request",
                             hashlib.sha256(canonical.encode()).hexdigest()])
        good = Sign.sign_tc3(self.secret(), auth.group(2), auth.group(3), to_sign) == auth.group(5)
        return {"signed_by": auth.group(1), "signature_ok": good, "token": lookup.get("x-tc-token"),
                "action": lookup.get("x-tc-action"), "version": lookup.get("x-tc-version"),
                "params": json.loads(body)}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _metadata(cloud: str, instance: str) -> FakeMetadata:
    meta = FakeMetadata(cloud)
    region = {"aws": "us-east-1", "alicloud": "cn-hangzhou", "tencentcloud": "ap-guangzhou"}[cloud]
    meta.extra.update({"/latest/meta-data/instance-id": instance, "/latest/meta-data/placement/region": region,
                       "/latest/meta-data/region-id": region})
    return meta


def _moto_group(moto: MotoServer) -> tuple[str, str]:
    """A real Auto Scaling group with one instance in moto: (group name, instance id)."""
    import boto3

    client = boto3.client("autoscaling", endpoint_url=moto.url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_launch_configuration(LaunchConfigurationName="gts-lc", ImageId="ami-12c6146b",
                                       InstanceType="p4d.24xlarge")
    client.create_auto_scaling_group(AutoScalingGroupName="prod-aws-train-asg", LaunchConfigurationName="gts-lc",
                                     MinSize=1, MaxSize=2, DesiredCapacity=1, AvailabilityZones=["us-east-1a"])
    instance = client.describe_auto_scaling_groups()["AutoScalingGroups"][0]["Instances"][0]["InstanceId"]
    return "prod-aws-train-asg", instance


def _health(moto: MotoServer, instance: str) -> tuple[str, str]:
    import boto3

    client = boto3.client("autoscaling", endpoint_url=moto.url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    found = client.describe_auto_scaling_instances(InstanceIds=[instance])["AutoScalingInstances"][0]
    return found["AutoScalingGroupName"], found["HealthStatus"]


def _committed(ckpt: Path) -> list[str]:
    if not ckpt.exists():
        return []
    return sorted(p.name for p in ckpt.iterdir() if re.fullmatch(r"step-\d{8}", p.name)
                  and (p / "manifest-node000.json").exists())


def _trainer(tmp: Path, ckpt: Path, **extra: str) -> Run:
    """The image's entrypoint running the real trainer (tiny workload, one CPU worker)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "1", "NPROC_PER_NODE": "1",
           "WORKLOAD": "tiny", "TRAIN_STEPS": "100000", **extra}
    proc = subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh"), "--checkpoint-dir", str(ckpt),
                             "--checkpoint-every", "20", "--log-every", "10", "--throttle-ms", "20"],
                            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    run = Run(proc)
    run.start_reader()
    return run


def _bucket_env(api: ScalingApi) -> dict[str, str]:
    """node.env's bucket settings, the bucket on the fake's address (path style)."""
    return {"GTS_BUNDLE_URL": "s3://gts-bucket/nodes/bundle-0.tar.gz.b64", "STORAGE_ENDPOINT_URL": api.url,
            "STORAGE_REGION": "ap-guangzhou", "STORAGE_ADDRESSING_STYLE": "path"}


def _watch(cloud: str, meta: FakeMetadata, api: ScalingApi, trainer_pid: int, tmp: Path,
           *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    kmsg = tmp / "kmsg"
    kmsg.touch()
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "watch", "--cloud", cloud, "--group", f"{cloud}-train",
         "--action", f"pid:{trainer_pid}", "--metadata-url", meta.url, "--api-url", api.url,
         "--kernel-log", str(kmsg), "--textfile-dir", str(tmp / "tf"), "--run-dir", str(tmp / "run"),
         "--table", str(ROOT / "infra/data/gpu_health.yaml"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "GTS_LIB": str(ROOT / "training"), **(env or {})})


def _watching(tmp: Path, watcher: subprocess.Popen[str]) -> None:
    """The event the tests wait on: the watch wrote its first metrics (it follows the log now)."""
    from tests.training_helpers import retry_until

    up = tmp / "tf" / "gts_gpu_watch.prom"
    assert retry_until(lambda: up.exists() or watcher.poll() is not None, LAUNCH_TIMEOUT)
    assert up.exists(), watcher.communicate()[0]


def _log(tmp: Path, line: str) -> None:
    with open(tmp / "kmsg", "a", encoding="utf-8") as fh:
        fh.write(line)


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


# ---------------------------------------------------------------------------- the boot gate

def _gate(tmp: Path, tools: Path, meta: FakeMetadata, api: ScalingApi, *args: str,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "gate", "--cloud", meta.cloud, "--group", "ali-train", "--metadata-url", meta.url,
         "--api-url", api.url, "--textfile-dir", str(tmp / "tf"), "--run-dir", str(tmp / "run"), *args],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
        env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "GTS_LIB": str(ROOT / "training"), **(env or {})})


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


def test_the_trainer_unit_requires_the_gate_and_the_node_gets_the_types_expectations() -> None:
    from infra import userdata
    from infra.groups import resolve
    from infra.stackfile import load_stack_spec

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
    assert found["tc-train"][:2] == ("as:DescribeAutoScalingGroups,as:RemoveInstances,as:ModifyDesiredCapacity",
                                     "qcs::as:ap-guangzhou:uin/*:autoscalinggroup/tc-train-asg-id")
    # The group's nodes learn its id from the object the plan writes once the group exists, under
    # the prefix their role reads already (no new grant).
    [obj] = [r for r in by_type(res, "tencentcloud:Cos/bucketObject:BucketObject") if r.name == "prod-tc-train-group-id"]
    assert obj.inputs["content"] == "tc-train-asg-id" and obj.inputs["key"] == "nodes/scaling-groups/tc-train"
    from infra.buckets import NODES_PREFIX
    assert obj.inputs["key"].startswith(NODES_PREFIX) and health.node_replace.group_id_key("tc-train") == obj.inputs["key"]
    # Nothing else grants these actions (nor a wildcard over the scaling services).
    for r in res:
        text = json.dumps(r.inputs)
        if "replace-self" in r.name or r.type == "kubernetes:core/v1:ConfigMap" and r.name.endswith("-gpu-gate"):
            continue  # the grants themselves; the gate script's own text (a Job's init container)
        for action in ("SetInstanceHealth", "RemoveInstances", "ModifyDesiredCapacity", "autoscaling:*", "ess:*", "as:*"):
            assert action not in text, f"{r.name} ({r.type}) mentions {action}"


def test_the_gpu_health_alerts_read_series_the_node_writes_and_promtool_accepts_them(tmp_path: Path) -> None:
    from infra import monitoring
    from infra.stackfile import load_stack_spec
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
        args = type("Args", (), {"group_id": "", "group": "tc-train"})()
        os.environ.update(_bucket_env(api))
        with pytest.raises(ValueError, match="not a scaling-group id"):
            health.tencent_group_id(args, creds)
    finally:
        for key in _bucket_env(api):
            os.environ.pop(key, None)
        api.stop()
        meta.stop()
    assert [c["action"] for c in api.calls] == ["GetObject"]


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


def test_only_groups_without_a_scaling_group_render_replace_none() -> None:
    from infra import gpu_health as gh
    from infra import userdata
    from infra.groups import resolve
    from infra.stackfile import load_stack_spec

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

    from infra import gpu_health as gh
    from infra import userdata
    from infra.groups import resolve
    from infra.spec import GpuHealth
    from infra.stackfile import load_stack_spec

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
