"""Issue 41: a VM node reads its group's rendezvous key from the cloud's secret store at boot,
with its instance role, into a file only root reads; the user data names where the key is.

The node's own script (cloudinit/scripts/gts-rdzv-key.py, run as gts-trainer.service runs it)
against: moto's real SSM (a SecureString parameter) behind a SigV4 check; and for Alibaba's OOS
GetSecretParameter and Tencent's SSM GetSecretValue, local endpoints that check the request's
signature with each cloud's own SDK code (tests/gpu_health_helpers.py ScalingApi.check) and
answer as the APIs document. Credentials come from the fake metadata service, as on a node."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.gpu_health_helpers import ScalingApi, _metadata
from tests.training_helpers import ROOT, MotoServer

KEY = "k3y-" + "x" * 44
REFS = {"aws": "/gts/prod/aws-train/rdzv-key", "alicloud": "gts/prod/ali-train/rdzv-key",
        "tencentcloud": "gts-prod-tc-train-rdzv-key"}
REGIONS = {"aws": "us-east-1", "alicloud": "cn-hangzhou", "tencentcloud": "ap-guangzhou"}


class SecretStore:
    """One cloud's secret API on 127.0.0.1: signature checked, the one secret served (AWS: to moto)."""

    def __init__(self, cloud: str, signer: ScalingApi, forward: str = ""):
        self.cloud, self.signer, self.forward = cloud, signer, forward
        self.calls: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                self.reply(owner.handle(self.command, self.path, dict(self.headers.items()), b""))

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.reply(owner.handle(self.command, self.path, dict(self.headers.items()), body))

            def reply(self, answer: tuple[int, bytes]) -> None:
                self.send_response(answer[0])
                self.send_header("Content-Length", str(len(answer[1])))
                self.end_headers()
                self.wfile.write(answer[1])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/"

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        if self.cloud == "aws":
            call = self.signer.check_sigv4(method, path, headers, body)
            self.calls.append({**call, "target": headers.get("X-Amz-Target"), "body": json.loads(body)})
            if not call["signature_ok"]:
                return 400, b'{"__type": "InvalidSignatureException"}'
            req = urllib.request.Request(self.forward + path, data=body, method=method,
                                         headers={k: v for k, v in headers.items() if k.lower() != "host"})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as err:
                return err.code, err.read()
        call = self.signer.check(method, path, headers, body)
        self.calls.append(call)
        params = call["params"]
        if self.cloud == "alicloud":
            if not call["signature_ok"]:
                return 400, b'{"Code": "SignatureDoesNotMatch"}'
            if (params.get("Action"), params.get("Version"), params.get("WithDecryption")) != (
                    "GetSecretParameter", "2019-06-01", "true") or params.get("Name") != REFS["alicloud"]:
                return 404, b'{"Code": "EntityNotExists.SecretParameter"}'
            return 200, json.dumps({"RequestId": "r-1", "Parameter": {"Name": params["Name"], "Value": KEY,
                                                                     "Type": "Secret"}}).encode()
        scope = headers["Authorization"].split("Credential=")[1].split(",")[0].split("/")
        if not call["signature_ok"] or scope[2] != "ssm" or call["version"] != "2019-09-23":
            found: dict[str, Any] = {"Error": {"Code": "AuthFailure.SignatureFailure", "Message": "signature"}}
        elif call["action"] != "GetSecretValue" or params != {"SecretName": REFS["tencentcloud"], "VersionId": "v1"}:
            found = {"Error": {"Code": "ResourceNotFound", "Message": "no such secret"}}
        else:
            found = {"SecretName": params["SecretName"], "VersionId": "v1", "SecretString": KEY}
        return 200, json.dumps({"Response": {**found, "RequestId": "r-1"}}).encode()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fetch(tmp: Path, cloud: str, meta_url: str, endpoint: str, ref: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    env_file, out = tmp / "node.env", tmp / "run" / "rdzv.env"
    env_file.write_text(f"GTS_CLOUD={cloud}\nGTS_RDZV_KEY_REF={ref}\nSTORAGE_REGION={REGIONS[cloud]}\n"
                        f"GTS_METADATA_URL={meta_url}\n")
    proc = subprocess.run([sys.executable, str(ROOT / "cloudinit/scripts/gts-rdzv-key.py"), "--env", str(env_file),
                           "--out", str(out), "--endpoint", endpoint, "--attempts", "1"],
                          env={"GTS_LIB": str(ROOT / "training"), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    return proc, out


@pytest.mark.parametrize("cloud", ["aws", "alicloud", "tencentcloud"])
def test_a_node_reads_its_key_with_its_role_into_a_private_file(tmp_path: Path, cloud: str) -> None:
    meta = _metadata(cloud, "i-node").start()
    signer = ScalingApi(cloud, meta)
    moto = MotoServer() if cloud == "aws" else None
    store = SecretStore(cloud, signer, forward=moto.url if moto else "")
    try:
        if moto is not None:
            import boto3

            boto3.client("ssm", endpoint_url=moto.url, region_name="us-east-1", aws_access_key_id="testing",
                         aws_secret_access_key="testing").put_parameter(Name=REFS["aws"], Value=KEY, Type="SecureString")
        proc, out = fetch(tmp_path, cloud, meta.url, store.url, REFS[cloud])
        assert proc.returncode == 0, proc.stderr
        assert out.read_text() == f"RDZV_KEY={KEY}\n"
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        assert KEY not in proc.stdout + proc.stderr, "the key is never printed"
        [call] = store.calls
        assert call["signature_ok"] and call["signed_by"] == meta.access_key() and call["token"], call
        if cloud == "aws":
            assert call["target"] == "AmazonSSM.GetParameter" and call["body"] == {"Name": REFS["aws"],
                                                                                   "WithDecryption": True}
        # Another group's key (a name this role may not read, here: one that is not there) is
        # refused with one line naming it, and nothing is written.
        other = tmp_path / "other"
        other.mkdir()
        proc, out = fetch(other, cloud, meta.url, store.url, REFS[cloud] + "-other")
        assert proc.returncode != 0 and not out.exists(), proc.stderr
        [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert "gts-rdzv-key" in line and REFS[cloud] + "-other" in line, proc.stderr
    finally:
        store.stop()
        signer.stop()
        meta.stop()
        if moto is not None:
            moto.stop()


def test_a_single_node_group_needs_no_key(tmp_path: Path) -> None:
    env_file, out = tmp_path / "node.env", tmp_path / "rdzv.env"
    env_file.write_text("GTS_CLOUD=aws\nSTORAGE_REGION=us-east-1\n")
    proc = subprocess.run([sys.executable, str(ROOT / "cloudinit/scripts/gts-rdzv-key.py"), "--env", str(env_file),
                           "--out", str(out)], env={"GTS_LIB": str(ROOT / "training")}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and not out.exists(), proc.stderr


def test_the_trainer_unit_fetches_the_key_and_hands_the_file_to_the_container() -> None:
    unit = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    fetch_line = next(i for i, ln in enumerate(unit.splitlines()) if "gts-rdzv-key.py" in ln)
    start_line = next(i for i, ln in enumerate(unit.splitlines()) if ln.startswith("ExecStart="))
    assert fetch_line < start_line and unit.splitlines()[fetch_line].startswith("ExecStartPre=/usr/bin/python3")
    assert "${GTS_RDZV_KEY_REF:+--env-file /run/gpu-training/rdzv.env}" in unit
    from infra.render.bundle import FILES

    assert any(src == "cloudinit/scripts/gts-rdzv-key.py" for _, _, src in FILES)
