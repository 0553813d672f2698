"""`make bench`: checkpoint and resume figures for a ~100 MB and a ~1 GB training state, against
a real S3 endpoint (moto server) on 127.0.0.1. Figures are printed, measured in one run; nothing
here asserts a time.

  ours             seconds the loop waits per checkpoint: the state copied into reused buffers;
                   serialising (hashed while written, no torch CRC), fsync, commit and upload run
                   in the background
  sync+upload      seconds it would wait for all of that in line
  dcp async        torch.distributed.checkpoint.async_save with a reused stager, same state
  durable          seconds from the start of a checkpoint until its manifest is in the bucket
  resume           seconds from process start to the first step after a resume from the bucket
Each is measured REPEATS times in one run (min / median); then the goodput table: Daly's interval
and the simulated goodput at several MTBFs, with and without a two-minute reclaim notice.
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


REPEATS = 3
MTBFS_H = (1, 6, 24)
NOTICE_S = 120.0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _ours(state: dict[str, object], work: Path, remote: str, topo: Topology) -> tuple[float, float, float]:
    """(loop blocked, durable in the bucket) for one checkpoint through the manager: the state
    copied into reused buffers, written, hashed, committed and uploaded in the background."""
    mgr = CheckpointManager(str(work), remote, topo, keep=2)
    blocked, durable = [], []
    for step in range(1, REPEATS + 1):
        started = time.perf_counter()
        blocked.append(mgr.save(step, state, {"rng": torch.get_rng_state()}, lambda: None))
        mgr.wait_uploads(600)
        durable.append(time.perf_counter() - started)
    mgr.close()
    return min(blocked), _median(blocked), _median(durable)


def _sync(state: dict[str, object], work: Path, remote: str, topo: Topology) -> list[float]:
    """The loop waits for everything: torch.save with CRC, sha256 by reading back, fsync, upload."""
    times = []
    for step in range(1, REPEATS + 1):
        mgr = CheckpointManager(str(work / str(step)), f"{remote}/{step}", topo, keep=2, background=False)
        started = time.perf_counter()
        mgr.save(step, state, {"rng": torch.get_rng_state()}, lambda: None)
        mgr.wait_uploads(600)
        times.append(time.perf_counter() - started)
        mgr.close()
    return times


def _dcp_async(state: dict[str, object], work: Path) -> list[float]:
    """torch.distributed.checkpoint.async_save with one stager reused across saves: the seconds
    until it returns (the loop's wait)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=torch.cuda.is_available()))
    times = []
    for step in range(1, REPEATS + 1):
        started = time.perf_counter()
        pending = async_save(state, checkpoint_id=str(work / f"dcp-{step}"), async_stager=stager, no_dist=True)
        times.append(time.perf_counter() - started)
        (pending.upload_completion if isinstance(pending, AsyncSaveResponse) else pending).result()
    stager.close()
    return times


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
            ours_min, ours_med, durable = _ours(state, work / f"ours-{width}", remote, topo)
            sync = _sync(state, work / f"sync-{width}", remote + "-sync", topo)
            dcp = _dcp_async(state, work / f"dcp-{width}")
            resume = [_resume_seconds(width, remote, env, work, i) for i in range(REPEATS)]
            rows.append({"label": label, "mb": size / 1e6, "ours": (ours_min, ours_med), "durable": durable,
                         "sync": (min(sync), _median(sync)), "dcp": (min(dcp), _median(dcp)),
                         "resume": (min(resume), _median(resume))})
            del state
    finally:
        moto.terminate()
        shutil.rmtree(work, ignore_errors=True)
    _print_checkpoint_table(rows)
    _print_goodput_table(rows)
    return 0


def _print_checkpoint_table(rows: list[dict[str, object]]) -> None:
    print(f"checkpoint: loop-blocked seconds, min / median of {REPEATS}")
    print(f"{'state':>8} {'MB':>6} {'ours':>13} {'sync+upload':>13} {'dcp async':>13} {'sync/ours':>10} "
          f"{'dcp/ours':>9} {'durable':>8} {'resume':>13}")
    for r in rows:
        ours, sync, dcp, resume = r["ours"], r["sync"], r["dcp"], r["resume"]
        assert isinstance(ours, tuple) and isinstance(sync, tuple) and isinstance(dcp, tuple)
        assert isinstance(resume, tuple)
        print(f"{r['label']:>8} {r['mb']:6.0f} {ours[0]:6.2f}/{ours[1]:<6.2f} {sync[0]:6.2f}/{sync[1]:<6.2f} "
              f"{dcp[0]:6.2f}/{dcp[1]:<6.2f} {sync[1] / ours[1]:9.1f}x {dcp[1] / ours[1]:8.2f}x "
              f"{r['durable']:7.2f}s {resume[0]:6.2f}/{resume[1]:<6.2f}")


def _print_goodput_table(rows: list[dict[str, object]]) -> None:
    from training import goodput

    print(f"\ngoodput: δ = the median loop-blocked time above, R = the median resume, reclaims Poisson "
          f"({goodput.HORIZON_FAILURES} per trace, seed 1), auto = Daly's interval")
    print(f"{'state':>8} {'δ s':>6} {'MTBF':>5} {'auto, no notice':>22} {'auto, 2-min notice':>24} "
          f"{'notice->durable':>16}")
    for r in rows:
        ours, resume, durable = r["ours"], r["resume"], r["durable"]
        assert isinstance(ours, tuple) and isinstance(resume, tuple) and isinstance(durable, float)
        delta, restart = max(ours[1], 1e-3), resume[1]
        for hours in MTBFS_H:
            mtbf = hours * 3600.0
            times = goodput.trace_times(f"poisson:{mtbf}:1")
            cells = []
            for notice in (0.0, NOTICE_S):
                found = goodput.plan(delta, mtbf, restart, notice, durable)
                sim = goodput.simulate(times, found.interval_s, delta, restart, notice, durable)
                every = "never" if found.interval_s == float("inf") else f"{found.interval_s:.0f} s"
                cells.append(f"{every:>9} {sim:7.2%}")
            fits = "fits" if durable <= NOTICE_S else "TOO LONG"
            print(f"{r['label']:>8} {delta:6.2f} {hours:4d}h {cells[0]:>22} {cells[1]:>24} {durable:8.1f} s {fits}")


def _resume_seconds(width: int, remote: str, env: dict[str, str], work: Path, attempt: int = 0) -> float:
    """A fresh process (empty local disk) resumes `remote` and runs one more step."""
    cwd = work / f"resume-{width}-{attempt}"
    cwd.mkdir()
    remote = f"{remote}-trainer-{attempt}"
    base = [sys.executable, "-m", "training.train", "--workload", "tiny", "--tiny-width", str(width),
            "--checkpoint-dir", remote, "--log-every", "1"]
    child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    # A trainer-made checkpoint at step 1, uploaded; then the local disk is wiped.
    subprocess.run([*base, "--steps", "1", "--checkpoint-every", "1", "--upload-deadline-s", "600"], cwd=cwd,
                   env=child_env, check=True, capture_output=True, timeout=900)
    shutil.rmtree(cwd / "out")
    cmd = [*base, "--steps", "2", "--checkpoint-every", "100", "--upload-deadline-s", "0", "--allow-config-change"]
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
