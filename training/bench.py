"""`make bench`: checkpoint and resume figures for a ~100 MB and a ~1 GB training state, against
a real S3 endpoint (moto server) on 127.0.0.1. Figures are printed, measured in one run; nothing
here asserts a time.

  blocked (bg)     seconds the training loop waits per checkpoint with background upload
  blocked (sync)   seconds it would wait with save + upload in line; the ratio compares them
  durable          seconds from the start of a checkpoint until its manifest is in the bucket
  resume           seconds from process start to the first step after a resume from the bucket
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from training.checkpoint import CheckpointManager, Topology
from training.models import TinyNet

SIZES = {"~100 MB": 2900, "~1 GB": 9150}  # tiny_width: model + AdamW state = 12 bytes/parameter
ROOT = Path(__file__).resolve().parents[1]


def _state(width: int) -> tuple[dict[str, object], int]:
    torch.manual_seed(0)
    model = TinyNet(32, width)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return state, size


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            import urllib.request

            urllib.request.urlopen(url, timeout=0.5)
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    return proc, url


def main() -> int:
    moto, url = _moto()
    env = {"STORAGE_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "STORAGE_ADDRESSING_STYLE": "path"}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="bench")
    topo = Topology(0, 0, 1, 0, 1, 1)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="gts-bench-"))
    try:
        for label, width in SIZES.items():
            state, size = _state(width)
            remote = f"s3://bench/{width}"
            mgr = CheckpointManager(str(work / f"bg-{width}"), remote, topo, keep=2)
            started = time.perf_counter()
            blocked_bg = mgr.save(1, state, {"rng": torch.get_rng_state()}, lambda: None)
            mgr.wait_uploads(600)
            durable = time.perf_counter() - started
            mgr.close()
            sync = CheckpointManager(str(work / f"sync-{width}"), remote + "-sync", topo, keep=2)
            started = time.perf_counter()
            sync.save(1, state, {"rng": torch.get_rng_state()}, lambda: None)
            sync.wait_uploads(600)
            blocked_sync = time.perf_counter() - started
            sync.close()
            resume = _resume_seconds(width, remote, env, work)
            rows.append((label, size / 1e6, blocked_bg, blocked_sync, durable, resume))
            del state
    finally:
        moto.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'state':>8} {'MB':>7} {'blocked bg s':>13} {'blocked sync s':>15} {'ratio':>7} {'durable s':>10} {'resume s':>9}")
    for label, mb, bg, sync_s, durable, resume in rows:
        print(f"{label:>8} {mb:7.0f} {bg:13.2f} {sync_s:15.2f} {sync_s / bg:6.1f}x {durable:10.2f} {resume:9.2f}")
    return 0


def _resume_seconds(width: int, remote: str, env: dict[str, str], work: Path) -> float:
    """A fresh process (empty local disk) resumes `remote` and runs one more step."""
    cwd = work / f"resume-{width}"
    cwd.mkdir()
    remote = f"{remote}-trainer"
    base = [sys.executable, "-m", "training.train", "--workload", "tiny", "--tiny-width", str(width),
            "--checkpoint-dir", remote, "--log-every", "1"]
    child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    # A trainer-made checkpoint at step 1, uploaded; then the local disk is wiped.
    subprocess.run([*base, "--steps", "1", "--checkpoint-every", "1", "--upload-deadline-s", "600"], cwd=cwd,
                   env=child_env, check=True, capture_output=True, timeout=900)
    shutil.rmtree(cwd / "out")
    cmd = [*base, "--steps", "2", "--checkpoint-every", "100", "--upload-deadline-s", "0"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    resumed = None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "resumed from step" in line:
            resumed = True
        if resumed and re.search(r"step 2 loss", line):
            elapsed = time.perf_counter() - started
            proc.wait(timeout=600)
            return elapsed
    proc.wait(timeout=600)
    raise RuntimeError(f"resume run for width {width} did not reach step 2 after resuming:\n{''.join(seen[-20:])}")


if __name__ == "__main__":
    sys.exit(main())
