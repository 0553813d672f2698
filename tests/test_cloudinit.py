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
from datetime import datetime, timezone
from email import message_from_bytes
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import userdata
from infra.render import bundle
from infra.resolve.groups import resolve
from tests.harness import ROOT
from infra.stack.stackfile import load_stack_spec
from tests.harness import by_type, shipped
from tests.metadata_server import FakeMetadata
from tests.training_helpers import LAUNCH_TIMEOUT, kill_tree, retry_until
from tests.system_tools import debian_tool

SCRIPTS = ROOT / "cloudinit" / "scripts"
GOLDEN = Path(__file__).parent / "golden"
LSBLK = Path(__file__).parent / "data" / "lsblk"
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


def _rendered(stack: str) -> dict[str, str]:
    stack_ = resolve(load_stack_spec(stack))
    return {f"{g.cloud}-{g.name}": userdata.render(userdata.node_context(stack_.spec, g, userdata.IMAGE_PLACEHOLDER))
            for g in stack_.groups}


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
    script.write_text(userdata.render_script(userdata.node_context(prod.spec, prod.group("ali-ack-train"), userdata.IMAGE_PLACEHOLDER)))
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
    from infra.plan.engine import unwrap_secrets  # a multi-node VM group's user data is a secret (its rendezvous key)

    res = list(shipped("prod"))
    carried: dict[str, str] = {}
    for r in by_type(res, "aws:ec2/launchTemplate:LaunchTemplate"):
        if r.inputs.get("userData"):
            carried[r.name] = base64.b64decode(unwrap_secrets(r.inputs)["userData"]).decode()
    for r in by_type(res, "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate") + by_type(res, "alicloud:cs/nodePool:NodePool"):
        if r.inputs.get("userData"):
            carried[r.name] = base64.b64decode(unwrap_secrets(r.inputs)["userData"]).decode()
    for r in by_type(res, "tencentcloud:As/scalingConfig:ScalingConfig") + by_type(res, "tencentcloud:Instance/instance:Instance"):
        if "-rdzv-" not in r.name:  # the rendezvous store (tests/test_contract_handover.py)
            carried[r.name] = base64.b64decode(unwrap_secrets(r.inputs)["userData"]).decode()
    for r in by_type(res, "tencentcloud:Kubernetes/nodePool:NodePool"):
        if (r.inputs.get("nodeConfig") or {}).get("userData"):
            carried[r.name] = base64.b64decode(unwrap_secrets(r.inputs)["nodeConfig"]["userData"]).decode()
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

def _trainer(marker: Path) -> subprocess.Popen[bytes]:
    """The image's real entrypoint (torchrun, one worker) running a stand-in worker."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "TRAIN_MODULE": "tests.stand_in_worker", "NPROC_PER_NODE": "1", "GTS_TEST_MARKER": str(marker)}
    return subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh")], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _worker_ready(marker: Path, launcher: subprocess.Popen[bytes]) -> None:
    """Waits for the event, not a time: the stand-in worker's handlers are installed."""
    ready = marker.with_name(marker.name + ".ready")
    assert retry_until(lambda: ready.exists() or launcher.poll() is not None, LAUNCH_TIMEOUT)
    assert ready.exists(), f"the worker never started (entrypoint exited {launcher.poll()})"


def _watcher_polled(meta: FakeMetadata, times: int) -> None:
    """Waits until the watcher has asked the metadata service `times` more times."""
    seen = meta.requests
    assert retry_until(lambda: meta.requests >= seen + times, LAUNCH_TIMEOUT), "the watcher never polled"


def _watch(cloud: str, tmp: Path) -> tuple[str, str, int]:
    notice = {"aws": json.dumps({"action": "terminate", "time": "2099-11-29T12:02:00Z"}),
              "alicloud": "2099-11-29T12:05:00Z", "tencentcloud": "2099-11-29 20:02:00"}[cloud]
    with FakeMetadata(cloud) as meta:
        saved = tmp / f"{cloud}-saved"
        launcher = _trainer(saved)
        textfiles, run_dir = tmp / cloud, tmp / f"{cloud}-run"
        watcher = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "gts-spot-watch.py"), "--cloud", cloud, "--action", f"pid:{launcher.pid}",
             "--metadata-url", meta.url, "--textfile-dir", str(textfiles), "--run-dir", str(run_dir), "--once",
             "--interval", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "GTS_LIB": str(ROOT / "training")})
        try:
            _worker_ready(saved, launcher)
            _watcher_polled(meta, 2)  # polls with no notice: nothing is signalled
            assert launcher.poll() is None and not saved.exists(), f"{cloud}: signalled before any notice"
            meta.spot_notice = notice
            code = launcher.wait(timeout=LAUNCH_TIMEOUT)
            out, _ = watcher.communicate(timeout=LAUNCH_TIMEOUT)
            assert (run_dir / "spot-notice").exists()
            return (textfiles / "gts_spot.prom").read_text(), out, code
        finally:
            for proc in (launcher, watcher):
                if proc.poll() is None:
                    kill_tree(proc.pid)  # torchrun runs in a session of its own


def test_spot_notice_reaches_the_workers_on_every_cloud(tmp_path: Path) -> None:
    """The watcher signals the container's entrypoint, which passes it to the workers, not to
    torchrun: they save and exit 0, and the entrypoint exits 0 with them."""
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
        metric, log, code = outcome
        assert code == 0, f"{cloud}: the stop was not clean ({log})"
        assert (tmp_path / f"{cloud}-saved").read_text() == "saved"
        assert f'gts_spot_interruption_notice{{cloud="{cloud}"}} 1' in metric
        assert "emergency checkpoint: the trainer exited" in log
    # Tencent's notice is Beijing time: 20:02 there is 12:02 UTC.
    utc = datetime(2099, 11, 29, 12, 2, tzinfo=timezone.utc).timestamp()
    assert f'gts_spot_interruption_time_seconds{{cloud="tencentcloud"}} {utc:.0f}' in results["tencentcloud"][0]


@pytest.mark.parametrize("path,body,expected", [
    ("/latest/meta-data/events/recommendations/rebalance", '{"noticeTime": "2026-11-29T12:00:00Z"}', "checkpoint now"),
    ("/latest/meta-data/autoscaling/target-lifecycle-state", "Terminated", "stopped"),
])
def test_aws_rebalance_and_scale_in_are_watched_too(path: str, body: str, expected: str, tmp_path: Path) -> None:
    """A rebalance recommendation asks for a checkpoint and training goes on; a scale-in (held by
    the group's lifecycle hook) is handled as a reclaim."""
    marker = tmp_path / "worker"
    launcher = _trainer(marker)
    _worker_ready(marker, launcher)
    with FakeMetadata("aws") as meta:
        meta.extra[path] = body
        watcher = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "gts-spot-watch.py"), "--cloud", "aws", "--action", f"pid:{launcher.pid}",
             "--metadata-url", meta.url, "--textfile-dir", str(tmp_path / "tf"), "--run-dir", str(tmp_path / "run"),
             "--interval", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "GTS_LIB": str(ROOT / "training")})
        try:
            assert retry_until(lambda: marker.exists() or launcher.poll() is not None, LAUNCH_TIMEOUT)
            if expected == "checkpoint now":
                assert marker.read_text() == "checkpoint now\n" and launcher.poll() is None  # goes on
                assert not (tmp_path / "run" / "spot-notice").exists()
            else:  # handled as a reclaim: the worker saved and the trainer stopped cleanly
                assert launcher.wait(timeout=20) == 0 and marker.read_text() == "saved"
                assert (tmp_path / "run" / "spot-notice").exists()
        finally:
            for proc in (launcher, watcher):
                if proc.poll() is None:
                    kill_tree(proc.pid)  # torchrun runs in a session of its own
