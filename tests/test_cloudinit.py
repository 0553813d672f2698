"""cloud-init user data: real `cloud-init schema`, top-level module keys, shellcheck, golden
snapshots, NVMe disk selection on recorded machines, and the spot-notice handler against a
local metadata server speaking each cloud's format."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import bundle, userdata
from infra.groups import resolve
from tests.harness import ROOT
from infra.stackfile import load_stack_spec
from tests.harness import by_type, shipped
from tests.system_tools import debian_tool

SCRIPTS = ROOT / "cloudinit" / "scripts"
GOLDEN = Path(__file__).parent / "golden"
LSBLK = Path(__file__).parent / "data" / "lsblk"
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


def _rendered(stack: str) -> dict[str, str]:
    stack_ = resolve(load_stack_spec(stack))
    return {f"{g.cloud}-{g.name}": userdata.render(userdata.node_context(stack_.spec, g)) for g in stack_.groups}


def _cloud_init() -> str:
    return debian_tool("cloud-init", "cloud-init")


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_rendering_passes_cloud_init_schema(stack: str, tmp_path: Path) -> None:
    tool = _cloud_init()
    for name, text in _rendered(stack).items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        proc = subprocess.run([tool, "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"


def _module_keys() -> set[str]:
    tool = _cloud_init()
    python = Path(tool).read_text().splitlines()[0].removeprefix("#!").strip() or "/usr/bin/python3"
    where = subprocess.run([python, "-c", "import cloudinit, os; print(os.path.dirname(cloudinit.__file__))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    schema = json.loads((Path(where) / "config" / "schemas" / "schema-cloud-config-v1.json").read_text())
    keys: set[str] = set()
    for ref in schema["allOf"]:
        keys |= set(schema["$defs"][ref["$ref"].split("/")[-1]].get("properties", {}))
    return keys


def test_top_level_keys_are_cloud_init_modules() -> None:
    """cloud-init schema (22.4) accepts a misspelled module key silently; check them ourselves."""
    known = _module_keys()
    assert "write_files" in known and "write_filez" not in known
    for stack in ("dev", "prod"):
        for name, text in _rendered(stack).items():
            unknown = set(yaml.safe_load(text)) - known
            assert not unknown, f"{name}: {unknown} are not cloud-init modules"


def _shellcheck(path: Path) -> None:
    proc = subprocess.run([SHELLCHECK, "-x", "-s", "bash", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_node_scripts_pass_shellcheck_and_compile(tmp_path: Path) -> None:
    sources = [bundle.ROOT / source for _, _, source in bundle.FILES]
    scripts = [p for p in sources if p.suffix == ".sh"]
    assert len(scripts) >= 5
    for path in scripts:
        _shellcheck(path)
    for path in (p for p in sources if p.suffix == ".py"):
        compile(path.read_text(), str(path), "exec")
    # What the user data embeds: the compacted fetcher compiles, and the script shape for ACK / TKE
    # node pools is shellchecked whole.
    compile(userdata.compact_python((ROOT / "training" / "cloudmeta.py").read_text()), "cloudmeta.py", "exec")
    prod = resolve(load_stack_spec("prod"))
    script = tmp_path / "node.sh"
    script.write_text(userdata.render_script(userdata.node_context(prod.spec, prod.group("ali-ack-train"))))
    _shellcheck(script)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, as a person would write them."""


_BlockDumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v,
                                                                   style="|" if "\n" in v else None))


def _normalized(text: str) -> str:
    """The rendered cloud-config with its embedded payloads named instead of spelled out (the
    fetcher's bytes and the bundle's sha change with every script edit; their decoding is tested
    in test_node_fetch.py)."""
    doc = yaml.safe_load(text)
    for f in doc["write_files"]:
        if f.get("encoding") == "gz+b64":
            assert gzip.decompress(base64.b64decode(f["content"]))
            f["content"] = f"<gz+b64 of {f['path']}>"
    body = yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False, width=120)
    return re.sub(r"bundle-[0-9a-f]{16}|[0-9a-f]{64}", "<bundle sha256>", text.split("write_files:")[0] + body)


def test_golden_snapshots_one_group_per_cloud() -> None:
    """Regenerate with UPDATE_GOLDEN=1 after an intended change, and review the diff (never in CI)."""
    rendered = _rendered("dev")
    assert sorted(rendered) == ["alicloud-ali-train", "aws-aws-train", "tencentcloud-tc-train"]
    for name, text in rendered.items():
        golden = GOLDEN / f"{name}.yaml"
        if os.environ.get("UPDATE_GOLDEN"):
            assert not os.environ.get("CI"), "golden files are reviewed changes, never rewritten in CI"
            golden.write_text(_normalized(text))
        assert golden.exists(), f"missing {golden}; run UPDATE_GOLDEN=1 pytest {__file__}"
        assert _normalized(text) == golden.read_text(), f"{name} differs from its golden file"


def test_plan_gpu_resources_carry_the_user_data() -> None:
    res = list(shipped("prod"))
    carried: dict[str, str] = {}
    for r in by_type(res, "aws:ec2/launchTemplate:LaunchTemplate"):
        if r.inputs.get("userData"):
            carried[r.name] = base64.b64decode(r.inputs["userData"]).decode()
    for r in by_type(res, "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate") + by_type(res, "alicloud:cs/nodePool:NodePool"):
        if r.inputs.get("userData"):
            carried[r.name] = base64.b64decode(r.inputs["userData"]).decode()
    for r in by_type(res, "tencentcloud:As/scalingConfig:ScalingConfig") + by_type(res, "tencentcloud:Instance/instance:Instance"):
        carried[r.name] = base64.b64decode(r.inputs["userData"]).decode()
    for r in by_type(res, "tencentcloud:Kubernetes/nodePool:NodePool"):
        if (r.inputs.get("nodeConfig") or {}).get("userData"):
            carried[r.name] = base64.b64decode(r.inputs["nodeConfig"]["userData"]).decode()
    assert len(carried) == 3 + 2 + 2 + 2  # system pools carry none
    for name, text in carried.items():
        cloud = "aws" if name.startswith("aws") else "alicloud" if name.startswith("ali") else "tencentcloud"
        assert f"GTS_CLOUD={cloud}" in text, name
        assert f"GTS_METADATA_URL={userdata.METADATA_URLS[cloud]}" in text, name
        assert f"GTS_BUNDLE_SHA256={bundle.build().sha256}" in text and "gts-fetch.service" in text, name
    eks = message_from_bytes(carried["aws-eks-train-lt"].encode())
    parts = [p.get_content_type() for p in eks.walk() if not p.is_multipart()]
    assert eks.is_multipart() and parts == ["text/cloud-config"]
    assert "GTS_MODE=kubernetes" in carried["ali-ack-train-pool"] and carried["ali-ack-train-pool"].startswith("#!/usr/bin/env bash")


@pytest.mark.parametrize("shape,expected", [
    ("aws-g5.xlarge-one-nvme", ["/dev/nvme1n1"]),
    ("aws-p4d.24xlarge-eight-nvme", [f"/dev/nvme{i}n1" for i in range(1, 9)]),
    ("aws-p3.2xlarge-ebs-only", ["/dev/xvdf"]),
    ("aws-root-on-nvme-ebs-data", ["/dev/nvme1n1"]),
    ("alicloud-virtio-data-disk", ["/dev/vdb"]),
    ("aws-p4d-rerun-raid-mounted", []),
    ("tencentcloud-foreign-filesystem", ["/dev/vdc"]),
])
def test_nvme_selection_never_takes_the_root_disk(shape: str, expected: list[str]) -> None:
    path = LSBLK / f"{shape}.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gts-disks.py"), "--lsblk-json", str(path)],
                          capture_output=True, text=True, check=True, timeout=60)
    chosen = proc.stdout.split()
    assert chosen == expected
    tree = json.loads(path.read_text())
    roots = {"/dev/" + d["name"] for d in tree["blockdevices"]
             if any(c.get("mountpoint") == "/" for c in d.get("children", []))}
    assert roots and not roots & set(chosen)


# -------------------------------------------------------------- spot notice handler

class Metadata(BaseHTTPRequestHandler):
    """Speaks one cloud's metadata format: token PUT (AWS, Alibaba), 404 until armed, then a notice."""

    cloud = "aws"
    armed_at: float | None = None
    token = "tok-123"

    def log_message(self, *args: Any) -> None:
        pass

    def do_PUT(self) -> None:  # noqa: N802
        header = {"aws": "X-aws-ec2-metadata-token-ttl-seconds",
                  "alicloud": "X-aliyun-ecs-metadata-token-ttl-seconds"}.get(self.cloud)
        if self.path != "/latest/api/token" or header is None or not self.headers.get(header):
            self.send_error(400)
            return
        self._reply(200, self.token)

    def do_GET(self) -> None:  # noqa: N802
        paths = {"aws": "/latest/meta-data/spot/instance-action",
                 "alicloud": "/latest/meta-data/instance/spot/termination-time",
                 "tencentcloud": "/latest/meta-data/spot/termination-time"}
        token_header = {"aws": "X-aws-ec2-metadata-token", "alicloud": "X-aliyun-ecs-metadata-token"}.get(self.cloud)
        if token_header and self.headers.get(token_header) != self.token:
            self.send_error(401)
            return
        if self.path != paths[self.cloud] or type(self).armed_at is None:
            self.send_error(404)
            return
        body = {"aws": json.dumps({"action": "terminate", "time": "2026-11-29T12:02:00Z"}),
                "alicloud": "2026-11-29T12:05:00Z", "tencentcloud": "2026-11-29 20:02:00"}[self.cloud]
        self._reply(200, body)

    def _reply(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _watch(cloud: str, tmp: Path) -> tuple[float, str]:
    handler: type[Metadata] = type(f"{cloud}Metadata", (Metadata,), {"cloud": cloud, "armed_at": None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    textfiles = tmp / cloud
    watcher = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "gts-spot-watch.py"), "--cloud", cloud, "--action", f"pid:{child.pid}",
         "--metadata-url", f"http://127.0.0.1:{server.server_port}", "--textfile-dir", str(textfiles), "--once"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(6)  # a poll or two with no notice: the child must still be running
        assert child.poll() is None, f"{cloud}: SIGTERM before any notice"
        handler.armed_at = time.monotonic()
        child.wait(timeout=15)
        elapsed = time.monotonic() - handler.armed_at
        watcher.wait(timeout=15)
        return elapsed, (textfiles / "gts_spot.prom").read_text()
    finally:
        for proc in (child, watcher):
            if proc.poll() is None:
                proc.kill()
        server.shutdown()


def test_spot_notice_sigterms_a_child_within_10s_on_every_cloud(tmp_path: Path) -> None:
    results: dict[str, Any] = {}

    def run(cloud: str) -> None:
        try:
            results[cloud] = _watch(cloud, tmp_path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[cloud] = exc

    threads = [threading.Thread(target=run, args=(c,)) for c in ("aws", "alicloud", "tencentcloud")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for cloud, outcome in results.items():
        assert not isinstance(outcome, BaseException), f"{cloud}: {outcome!r}"
        elapsed, metric = outcome
        assert elapsed < 10, f"{cloud}: SIGTERM {elapsed:.1f} s after the notice"
        assert f'gts_spot_interruption_notice{{cloud="{cloud}"}} 1' in metric
    # Tencent's notice is Beijing time: 20:02 there is 12:02 UTC.
    utc = datetime(2026, 11, 29, 12, 2, tzinfo=timezone.utc).timestamp()
    assert f'gts_spot_interruption_time_seconds{{cloud="tencentcloud"}} {utc:.0f}' in results["tencentcloud"][1]
