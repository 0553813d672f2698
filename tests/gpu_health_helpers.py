"""What the GPU health tests share (tests/test_gpu_health.py, test_gpu_health_gate.py,
test_gpu_health_plan.py): the node script (cloudinit/scripts/gts-gpu-health.py) loaded as a
module or run as its `watch` / `gate`, fake `nvidia-smi` / `dcgmi` / `systemctl`, the real
trainer under the image's entrypoint, and `ScalingApi`: a local endpoint for each cloud's
replace-me call that checks the node's signature with the cloud's own SDK code (moto's real
Auto Scaling API behind it for AWS)."""

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
from pathlib import Path
from typing import Any, Callable

from tests.harness import ROOT
from tests.metadata_server import FakeMetadata
from tests.training_helpers import BIN, LAUNCH_TIMEOUT, MotoServer, Run


SCRIPT = ROOT / "cloudinit" / "scripts" / "gts-gpu-health.py"
XID79 = "[ 1234.567] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
XID94 = "[ 99.1] NVRM: Xid (PCI:0000:3b:00): 94, pid=4242, name=python, Contained: SM (0x1). RST: No, D-RST: No\n"
# The replace calls' own tests run without the group's replacement budget (no bucket here);
# tests/test_replace_budget.py runs it.
NO_BUDGET = {"GTS_REPLACEMENTS_PER_HOUR": "0"}
INSTANCE = {"aws": "", "alicloud": "i-bp1ap6bro51a7fsa0001", "tencentcloud": "ins-cri8d02t"}
GROUP = {"alicloud": "asg-bp1fdwe2y0z4hle", "tencentcloud": "asg-boz1qhnk"}


def _watch_module() -> Any:
    sys.path[:0] = [str(ROOT / "training"), str(ROOT / "training" / "node")]  # its `import cloudmeta`, `import node_replace`
    import importlib.util
    spec = importlib.util.spec_from_file_location("gts_gpu_health", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- fake tools

def _fake_tools(tmp: Path, gpus: int, persistence: str = "Enabled", diag_rc: int = 0, links: int = 12,
                fabric: str = "active", dcgm: str = "running") -> Path:
    """nvidia-smi, dcgmi and systemctl as the gate calls them, answering like the real ones.
    `dcgm`: the host's nvidia-dcgm service is "running", "stopped" (starts when asked) or
    "absent" (no such unit: dcgmi finds no host engine)."""
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
if [ ! -e "{tmp}/dcgm-running" ]; then
  echo "Error: unable to establish a connection to the specified host: localhost"
  echo "Error: Unable to connect to host engine. Host engine connection invalid/disconnected."
  exit 255
fi
[ "$1" = discovery ] && {{ echo "8 GPUs found."; exit 0; }}
echo "| Diagnostic                | {'Pass' if diag_rc == 0 else 'Fail - GPU 3'} |"
exit {diag_rc}
""",
        "systemctl": f"""#!/bin/bash
echo "systemctl $*" >> "{tmp}/calls"
if [ "$1 $2" = "start nvidia-dcgm" ]; then
  [ "{dcgm}" = absent ] && {{ echo "Failed to start nvidia-dcgm.service: Unit nvidia-dcgm.service not found." >&2; exit 5; }}
  touch "{tmp}/dcgm-running"; exit 0
fi
echo {fabric}
""",
    }
    if dcgm == "running":
        (tmp / "dcgm-running").touch()
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
        if self.cloud == "aws":  # the query API: SigV4 over the form body
            return {**self.check_sigv4(method, path, headers, body),
                    "params": dict(urllib.parse.parse_qsl(body.decode()))}
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
        env={**os.environ, "GTS_LIB": str(ROOT / "training"), **NO_BUDGET, **(env or {})})


def _watching(tmp: Path, watcher: subprocess.Popen[str]) -> None:
    """The event the tests wait on: the watch wrote its first metrics (it follows the log now)."""
    from tests.training_helpers import retry_until

    up = tmp / "tf" / "gts_gpu_watch.prom"
    assert retry_until(lambda: up.exists() or watcher.poll() is not None, LAUNCH_TIMEOUT)
    assert up.exists(), watcher.communicate()[0]


def _log(tmp: Path, line: str) -> None:
    with open(tmp / "kmsg", "a", encoding="utf-8") as fh:
        fh.write(line)


def _gate(tmp: Path, tools: Path, meta: FakeMetadata, api: ScalingApi, *args: str,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "gate", "--cloud", meta.cloud, "--group", "ali-train", "--metadata-url", meta.url,
         "--api-url", api.url, "--textfile-dir", str(tmp / "tf"), "--run-dir", str(tmp / "run"), *args],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
        env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "GTS_LIB": str(ROOT / "training"), **NO_BUDGET,
             **(env or {})})
