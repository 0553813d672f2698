"""make bench's resume figures (training/trainer/bench.py): a fresh process resumes a step-1
checkpoint from the bucket with an empty local disk, timed from process start to its first step.

The methods of one group run interleaved like every other group's (bench.interleaved):
  limit          a fresh process that imports torch and GETs the library checkpoint's bytes
  fresh          the library method's loop with no checkpoint at all: import torch, the model given
                 memory without initial values (as the fast path builds it) and zero-filled,
                 AdamW, one step. Any resume of that loop does this much too, so it is the floor
                 under the resume rows that the import + read limit leaves out
  trainer        the reference trainer (training/trainer/train.py)
  library        the checkpoint library on the fast path its docs give (training/trainer/bench_library.py)
  library_plain  the library's three-line path (the model built and initialised first)
Each method that reads a checkpoint reads its own server-side copy of one written once before the group
(untimed), so none of them runs "right after the upload" more often than another, and each copy
is deleted after its run (the store keeps objects in memory). Every method is timed from its
start to a line it prints (the limit's after its last byte, the others' after their first step),
never to its exit: an exit (torch's and boto3's teardown) takes 0.3-0.6 s that no figure holds."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout (training/trainer/ is two folders down)
METHODS = ("limit", "fresh", "trainer", "library", "library_plain")


class ResumeGroup:
    """One state size's resume methods; `prepare` writes the two base checkpoints (untimed)."""

    def __init__(self, width: int, bucket: str, env: dict[str, str], work: Path):
        self.width, self.bucket, self.work = width, bucket, work
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.trainer_base, self.library_base = f"resume-{width}/trainer-base", f"resume-{width}/library-base"

    def _trainer_cmd(self, remote: str) -> list[str]:
        return [sys.executable, "-m", "training.trainer.train", "--workload", "tiny", "--tiny-width", str(self.width),
                "--checkpoint-dir", remote, "--log-every", "1"]

    def prepare(self) -> None:
        cwd = self.work / f"resume-{self.width}-prepare"
        cwd.mkdir(parents=True, exist_ok=True)
        subprocess.run([*self._trainer_cmd(f"s3://{self.bucket}/{self.trainer_base}"), "--steps", "1",
                        "--checkpoint-every", "1", "--upload-deadline-s", "600"], cwd=cwd, env=self.env, check=True,
                       capture_output=True, timeout=900)
        subprocess.run([sys.executable, "-m", "training.trainer.bench_library", "write", "--url",
                        f"s3://{self.bucket}/{self.library_base}", "--width", str(self.width)], cwd=cwd, env=self.env,
                       check=True, capture_output=True, timeout=900)
        shutil.rmtree(cwd, ignore_errors=True)

    def methods(self) -> dict[str, Callable[[int], dict[str, float]]]:
        return {name: self._method(name) for name in METHODS}

    def _method(self, name: str) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            reads = name != "fresh"  # the fresh start reads no checkpoint
            base = self.trainer_base if name == "trainer" else self.library_base
            prefix = f"resume-{self.width}/{name}-{rep}"
            if reads:
                _copy(self.env, self.bucket, base, prefix)
            remote = f"s3://{self.bucket}/{prefix}"
            cwd = self.work / f"resume-{self.width}-{name}-{rep}"
            try:
                cwd.mkdir(parents=True)
                if name == "limit":
                    return {"resume": _timed([sys.executable, "-c", _READ, self.env["STORAGE_ENDPOINT_URL"],
                                              f"{self.bucket}/{prefix}"], cwd, self.env, r"^read \d+ bytes$", None)}
                if name == "fresh":
                    return {"resume": _timed([sys.executable, "-m", "training.trainer.bench_library", "fresh", "--width",
                                              str(self.width)], cwd, self.env, r"^step 1 loss", None)}
                if name == "trainer":
                    cmd = [*self._trainer_cmd(remote), "--steps", "2", "--checkpoint-every", "100",
                           "--upload-deadline-s", "0", "--allow-config-change"]
                else:
                    cmd = [sys.executable, "-m", "training.trainer.bench_library", "resume", "--url", remote, "--width",
                           str(self.width), *(["--plain"] if name == "library_plain" else [])]
                return {"resume": _timed(cmd, cwd, self.env, r"step 2 loss")}
            finally:
                shutil.rmtree(cwd, ignore_errors=True)
                if reads:
                    _forget(self.env, self.bucket, prefix)
        return run


TIMEOUT_S = 600.0  # a method's process, start to exit: past it the process is killed, no figure


def _timed(cmd: list[str], cwd: Path, env: dict[str, str], until: str,
           after: str | None = "resumed from step", timeout_s: float = TIMEOUT_S) -> float:
    """Seconds from starting `cmd` to its first line matching `until` once a line holding `after`
    has been printed (at once, for None). The clock stops at that line, not at the exit; the
    process must still exit 0 within `timeout_s` of its start (it is killed otherwise, even one
    that prints nothing or keeps its output open), or there is no figure: an error with its last
    lines."""
    started = time.perf_counter()
    # its own process group: the watchdog ends whatever it started that still holds its output
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout_s, expire)
    watchdog.start()
    try:
        assert proc.stdout is not None
        ready, seen, elapsed = after is None, [], None
        for line in proc.stdout:
            seen.append(line)
            ready = ready or (after is not None and after in line)
            if elapsed is None and ready and re.search(until, line.rstrip("\n")):
                elapsed = time.perf_counter() - started
        code = proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()  # nothing when it has exited; a process that closed its output early is not left
        proc.wait()
    if elapsed is not None and code == 0:
        return elapsed
    what = f"was killed after {timeout_s:.0f} s" if timed_out.is_set() else f"exited {code}"
    reached = "after reaching" if elapsed is not None else "without reaching"
    raise RuntimeError(f"{' '.join(cmd[:4])} ... {what} {reached} {until!r}:\n{''.join(seen[-20:])}")


_READ = """
import sys
import boto3, torch
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
bucket, _, prefix = sys.argv[2].partition("/")
total = 0
for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
    total += len(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
assert total > 0, "nothing to read"
print(f"read {total} bytes", flush=True)
"""


def _s3(env: dict[str, str]) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=env["STORAGE_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"), aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"))


def _copy(env: dict[str, str], bucket: str, source: str, dest: str) -> None:
    """Every object under `source`/ copied to `dest`/ inside the store (untimed)."""
    s3 = _s3(env)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=source + "/"):
        for item in page.get("Contents", []):
            key = dest + item["Key"][len(source):]
            s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": item["Key"]})


def _forget(env: dict[str, str], bucket: str, prefix: str) -> None:
    """Delete every object under `prefix`/ from the bench's store."""
    s3 = _s3(env)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
