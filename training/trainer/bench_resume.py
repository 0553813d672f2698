"""make bench's resume figure (training/trainer/bench.py): a fresh trainer process that resumes a 1-step
checkpoint from the bucket with an empty local disk, timed from process start to its first step,
beside the limit: a fresh process that imports torch and reads the same bytes from the bucket."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (training/trainer/ is two folders down)


def resume_seconds(width: int, remote: str, env: dict[str, str], work: Path, attempt: int) -> dict[str, float]:
    """A fresh process (empty local disk) resumes `remote` and runs one more step; and the
    limit: a fresh process that imports torch and reads the same checkpoint's bytes."""
    cwd = work / f"resume-{width}-{attempt}"
    cwd.mkdir()
    remote = f"{remote}-trainer-{attempt}"
    base = [sys.executable, "-m", "training.trainer.train", "--workload", "tiny", "--tiny-width", str(width),
            "--checkpoint-dir", remote, "--log-every", "1"]
    child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    # A trainer-made checkpoint at step 1, uploaded; then the local disk is wiped.
    subprocess.run([*base, "--steps", "1", "--checkpoint-every", "1", "--upload-deadline-s", "600"], cwd=cwd,
                   env=child_env, check=True, capture_output=True, timeout=900)
    shutil.rmtree(cwd / "out")
    limit = _read_limit(remote, child_env)
    cmd = [*base, "--steps", "2", "--checkpoint-every", "100", "--upload-deadline-s", "0", "--allow-config-change"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    resumed = False
    seen = []
    for line in proc.stdout:
        seen.append(line)
        resumed = resumed or "resumed from step" in line
        if resumed and re.search(r"step 2 loss", line):
            elapsed = time.perf_counter() - started
            proc.wait(timeout=600)
            shutil.rmtree(cwd, ignore_errors=True)
            _forget(remote, child_env)  # the store keeps objects in memory: the next attempt starts as this one did
            return {"resume": elapsed, "limit": limit}
    proc.wait(timeout=600)
    raise RuntimeError(f"resume run for width {width} did not reach step 2 after resuming:\n{''.join(seen[-20:])}")


_READ = """
import sys, time
import boto3, torch
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
bucket, _, prefix = sys.argv[2].partition("/")
total = 0
for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
    total += len(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
print(total)
"""


def _forget(remote: str, env: dict[str, str]) -> None:
    """Delete every object under `remote` (s3://bucket/prefix) from the bench's store."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["STORAGE_ENDPOINT_URL"], region_name="us-east-1")
    bucket, _, prefix = remote.removeprefix("s3://").partition("/")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def _read_limit(remote: str, env: dict[str, str]) -> float:
    """Process start -> torch imported and every byte of the run's checkpoints read from the bucket."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", _READ, env["STORAGE_ENDPOINT_URL"], remote.removeprefix("s3://")],
                   env=env, check=True, capture_output=True, timeout=900)
    return time.perf_counter() - started
