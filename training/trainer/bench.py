"""`make bench`: checkpoint and resume figures for a ~100 MB and a ~1 GB training state, against
a real S3 endpoint (moto server) on 127.0.0.1, each beside the limit it cannot beat. Nothing here
asserts a time: the figures are printed, with the ratio to the limit and the target ratio.

The methods are interleaved: each repeat runs every method once, in an order that changes per
repeat (a Williams square, training/benchorder.py: every method in every position and after every
other method alike), so that a ratio compares measurements taken at the same moment of a loaded
machine and no method always follows the same neighbour. Every figure is min / median of REPEATS
(at least 3). The checkpoint methods with buffers of their own (ours, async_save, the sharded
path) start warm, as the memcpy limit does: one checkpoint of each is made before any clock, so no
repeat pays for allocating and faulting in its buffers, and from the first repeat on each save
also prunes the step `keep` leaves behind, as in a steady run. (The wall-per-checkpoint loop builds
its model and manager per repeat: its first of six saves allocates, as a run's first does.)

  blocked    seconds the loop waits per checkpoint. Ours: the state copied into reused buffers,
             everything else in the background. Limit: a copy into preallocated buffers (memcpy).
             Beside it: torch's async_save with a reused stager, and the in-line save.
             sharded: training/ckpt/sharded.py's path for FSDP / DTensor state (DCP's async_save,
             then our manifest, commit and upload), on one rank, beside the bare async_save.
  durable    seconds from the start of a checkpoint until it is fsync'd and committed on local
             disk. Limits: the same bytes written raw and fsync'd, through the page cache and
             around it (O_DIRECT, the way ours writes: training/ckpt/direct.py); ours' target is
             against the faster of the two. Beside it: the in-line save (torch.save with CRC, the
             hash by reading back, fsync).
  in bucket  seconds until its manifest is in the bucket (upload included).
  wall       what one checkpoint costs the training loop in wall time, everything included (the
             background writer shares the cores): a loop with a checkpoint every few steps minus
             the same loop without, per checkpoint. Next to it the loop-blocked time.
  resume     seconds from process start to the first step after a resume from the bucket (empty
             local disk): the reference trainer, the library on its documented fast path and on
             its three-line path (training/trainer/bench_resume.py). Limit: a fresh process that
             imports torch and reads the same bytes from the bucket; every method interleaved
             with the limit, each on its own copy of the checkpoint.
A limit that comes out slower than a method doing the same work and more (raw write + fsync
slower than the in-line save of the same bytes) is flagged and its ratios not reported.
Then the goodput table: Daly's interval and the simulated goodput at several MTBFs, with and
without a two-minute reclaim notice; and the offline plan figures (infra/plan/bench.py).

To iterate on one figure: `python -m training.trainer.bench --size "~1 GB" --part checkpoint` (or
`--part resume`, `--part plan`); without arguments everything, as `make bench` prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from training import benchorder
from training.trainer import bench_limits
from training.trainer.bench_resume import ResumeGroup
from training.trainer.bench_tables import REPEATS as REPEATS  # explicit re-export: callers read bench.REPEATS
from training.trainer.bench_tables import Figures, print_checkpoint_table, print_goodput_table
from training.ckpt.manager import CheckpointManager, Topology
from training.trainer.models import TinyNet
from training.ckpt.staging import Stager

SIZES = {"~100 MB": 2900, "~1 GB": 9150}  # tiny_width: model + AdamW state = 12 bytes/parameter
TOPO = Topology(0, 0, 1, 0, 1, 1)
PARTS = ("checkpoint", "resume", "plan")


def _state_bytes(width: int, dim: int = 32, classes: int = 10) -> int:
    """Model + AdamW's two moments, float32: the bytes of TinyNet(dim, width)'s state."""
    params = dim * width + width + width * width + width + width * classes + classes
    return params * 4 * 3


def _state(width: int) -> tuple[dict[str, object], int]:
    torch.manual_seed(0)
    model = TinyNet(32, width)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return state, size


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=0.5)
            break
        except OSError:  # not up yet
            time.sleep(0.1)
    return proc, url


def interleaved(methods: dict[str, Callable[[int], dict[str, float]]], repeats: int = REPEATS,
                settle: Callable[[], object] | None = None) -> dict[str, dict[str, list[float]]]:
    """Each repeat runs every method once, in benchorder's order for that repeat; each method
    returns named figures. Returns method -> figure -> one value per repeat. `settle` runs before
    each method, outside its clock (the checkpoint group's `os.sync`: no method's fsync pays for
    another's unwritten pages). What a neighbour leaves in memory still reaches the next method
    (docs/goodput-and-bench.md); the order spreads that over every method alike."""
    names = list(methods)
    out: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for rep in range(repeats):
        for name in benchorder.order(names, rep):
            if settle is not None:
                settle()
            for figure, value in methods[name](rep).items():
                out[name].setdefault(figure, []).append(value)
    return out


class Checkpoints:
    """The checkpoint methods for one state, each callable once per repeat."""

    def __init__(self, state: dict[str, object], work: Path, remote: str):
        self.state, self.work, self.remote = state, work, remote
        self.ours = CheckpointManager(str(work / "ours"), f"{remote}/ours", TOPO, keep=2)
        self.stager = Stager()
        self.stager.stage(state)  # the buffers exist, as they do from the second checkpoint on
        self.direct = bench_limits.Direct(_tensors(state), work)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self.dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=cuda))
        # ... and so do the methods' own, as the memcpy limit's above: one checkpoint of each
        # before any clock (a first one allocates and faults in its buffers, 0.22 s against
        # 0.10 s a GiB here, and counted in the first repeat of ours and of async_save alone).
        try:
            self.run_ours(-1)
            self.run_dcp(-1)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.ours.close()
        self.dcp_stager.close()
        self.direct.close()

    def run_ours(self, rep: int) -> dict[str, float]:
        step = rep + 1
        started, wall = time.perf_counter(), time.time()
        blocked = self.ours.save(step, self.state, {"rng": torch.get_rng_state()}, lambda: None)
        self.ours.wait_commit()
        # At the commit (the rename fsync'd), on the writer's clock: after it the writer still
        # prunes the step `keep` left behind (0.15 s a GiB here), which makes nothing durable.
        if self.ours.write_error or self.ours.status.last_commit < wall:
            raise RuntimeError(f"our checkpoint of step {step} was not committed: {self.ours.write_error}")
        durable = self.ours.status.last_commit - wall
        self.ours.wait_uploads(600)
        return {"blocked": blocked, "durable": durable, "bucket": time.perf_counter() - started}

    def run_inline(self, rep: int) -> dict[str, float]:
        """The loop waits for everything: torch.save with CRC, sha256 by reading back, fsync, upload."""
        mgr = CheckpointManager(str(self.work / f"inline-{rep}"), f"{self.remote}/inline-{rep}", TOPO, keep=2,
                                background=False)
        started = time.perf_counter()
        mgr.save(1, self.state, {"rng": torch.get_rng_state()}, lambda: None)
        durable = time.perf_counter() - started
        mgr.wait_uploads(600)
        bucket = time.perf_counter() - started
        mgr.close()
        return {"blocked": bucket, "durable": durable, "bucket": bucket}

    def run_dcp(self, rep: int) -> dict[str, float]:
        """torch.distributed.checkpoint.async_save with one stager reused across saves: the
        seconds until it returns (the loop's wait) and until its files are written."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        started = time.perf_counter()
        pending = async_save(self.state, checkpoint_id=str(self.work / f"dcp-{rep}"), async_stager=self.dcp_stager,
                             no_dist=True)
        blocked = time.perf_counter() - started
        (pending.upload_completion if isinstance(pending, AsyncSaveResponse) else pending).result()
        return {"blocked": blocked, "durable": time.perf_counter() - started}

    def run_memcpy(self, rep: int) -> dict[str, float]:
        """The limit of the loop's wait: a copy into buffers that already exist."""
        started = time.perf_counter()
        self.stager.stage(self.state)
        return {"blocked": time.perf_counter() - started}

    def run_raw(self, rep: int) -> dict[str, float]:
        """The limit of durable through the page cache (bench_limits.buffered)."""
        return bench_limits.buffered(_tensors(self.state), self.work / f"raw-{rep}")

    def run_raw_direct(self, rep: int) -> dict[str, float]:
        """The limit of durable around the page cache, the way ours writes (bench_limits.Direct)."""
        return self.direct.run(self.work / f"raw-direct-{rep}")


class Sharded:
    """training/ckpt/sharded.py's path on one rank (a model and AdamW of the same size): DCP's
    async_save, then the manifest, commit and upload of our manager. Beside `run_dcp` it shows
    what our bookkeeping adds to the loop's wait and to the time until the step is committed."""

    def __init__(self, width: int, work: Path, remote: str):
        from training.distributed import Comm
        from training.ckpt.sharded import ShardedCheckpoints

        torch.manual_seed(0)
        self.model = TinyNet(32, width)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.model(torch.randn(4, 32)).sum().backward()
        self.optimizer.step()
        self.manager = CheckpointManager(str(work / "sharded"), f"{remote}/sharded", TOPO, keep=2)
        self.ckpt = ShardedCheckpoints(self.manager, Comm("torchrun"))
        try:
            self.run(-1)  # warm, as Checkpoints' methods are
        except BaseException:
            self.close()
            raise

    def run(self, rep: int) -> dict[str, float]:
        step = rep + 1
        started = time.perf_counter()
        blocked = self.ckpt.save(step, self.model, self.optimizer, {"step": step, "world_size": 1},
                                 {"rng": torch.get_rng_state()})
        self.ckpt.wait()
        durable = time.perf_counter() - started
        if self.manager.write_error:
            raise RuntimeError(f"the sharded checkpoint of step {step} was not committed: {self.manager.write_error}")
        self.manager.wait_uploads(600)
        return {"blocked": blocked, "durable": durable, "bucket": time.perf_counter() - started}

    def close(self) -> None:
        self.ckpt.close()
        self.manager.close()


def _wall_per_checkpoint(width: int, work: Path, every: int = 5, steps: int = 30) -> Callable[[int], dict[str, float]]:
    """One method for `interleaved`: a real training loop with and without background
    checkpoints; the extra wall time per checkpoint, and the loop-blocked time it reported."""
    def run(rep: int) -> dict[str, float]:
        torch.manual_seed(0)
        model = TinyNet(32, width)
        opt = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))

        def loop(mgr: CheckpointManager | None) -> tuple[float, float]:
            blocked = 0.0
            started = time.perf_counter()
            for step in range(1, steps + 1):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                if mgr is not None and step % every == 0:
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                    blocked += mgr.save(step, state, {"rng": torch.get_rng_state()}, lambda: None)
            if mgr is not None:
                mgr.close()
            return time.perf_counter() - started, blocked

        plain, _ = loop(None)
        folder = work / f"wall-{width}-{rep}"
        with_ckpt, blocked = loop(CheckpointManager(str(folder), None, TOPO, keep=2))
        shutil.rmtree(folder, ignore_errors=True)
        count = steps // every
        return {"wall": max(with_ckpt - plain, 0.0) / count, "blocked": blocked / count}
    return run


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.trainer.bench", description="make bench's figures; "
                                     "without arguments all of them (what `make bench` prints)")
    parser.add_argument("--size", action="append", choices=list(SIZES), metavar="SIZE",
                        help=f"only this state size ({', '.join(SIZES)}; repeatable)")
    parser.add_argument("--part", action="append", choices=PARTS,
                        help="only these figures: checkpoint (blocked, durable, in bucket, wall), resume, plan "
                             "(repeatable); the goodput table needs checkpoint and resume")
    parser.add_argument("--repeats", type=int, default=REPEATS, metavar="N",
                        help=f"repeats of every interleaved group (default {REPEATS}, at least 3): more where the "
                             "disk's fsync time is noisy")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats}: at least 3 (a median of fewer says nothing)")
    args.size = args.size or list(SIZES)
    args.part = args.part or list(PARTS)
    return args


def _checkpoint_figures(width: int, work: Path, repeats: int = REPEATS) -> Figures:
    """Every method of one size, interleaved: ours, in line, async_save, memcpy, the raw limits
    (the direct one where the file system takes O_DIRECT), sharded."""
    state, _ = _state(width)
    ck = Checkpoints(state, work / f"w{width}", f"s3://bench/{width}")
    try:  # the methods' warm-up checkpoints can fail like any other: nothing is left open
        sharded = Sharded(width, work / f"w{width}", f"s3://bench/{width}")
    except BaseException:
        ck.close()
        raise
    methods: dict[str, Callable[[int], dict[str, float]]] = {
        "ours": ck.run_ours, "inline": ck.run_inline, "dcp": ck.run_dcp, "memcpy": ck.run_memcpy,
        "raw": ck.run_raw, "raw_direct": ck.run_raw_direct, "sharded": sharded.run}
    if not ck.direct.supported:
        del methods["raw_direct"]
    try:  # settle: each durable figure pays for its own bytes alone
        figures = interleaved(methods, repeats, settle=os.sync)
    finally:
        ck.close()
        sharded.close()
    if width == SIZES["~100 MB"]:
        figures |= interleaved({"wall": _wall_per_checkpoint(width, work)}, repeats)
    return figures


@contextlib.contextmanager
def _store() -> Iterator[dict[str, str]]:
    """A fresh S3 endpoint (moto on 127.0.0.1) with an empty bucket `bench`, stopped afterwards:
    moto holds every object in memory, so each group of figures starts with none of the last
    group's gigabytes (they pushed the page cache out and slowed the figures after them)."""
    moto, url = _moto()
    env = {"STORAGE_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "STORAGE_ADDRESSING_STYLE": "path"}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="bench")
        yield env
    finally:
        moto.terminate()
        moto.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = []
    if {"checkpoint", "resume"} & set(args.part):
        work = Path(tempfile.mkdtemp(prefix="gts-bench-"))
        try:
            for label in args.size:
                width = SIZES[label]
                figures: Figures = {}
                if "checkpoint" in args.part:
                    with _store():
                        figures = _checkpoint_figures(width, work, args.repeats)
                if "resume" in args.part:
                    with _store() as env:
                        group = ResumeGroup(width, "bench", env, work)
                        group.prepare()
                        figures |= interleaved(group.methods(), args.repeats)
                rows.append((label, _state_bytes(width) / 1e6, figures))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1 / 5 / 15 min, at the end)")
        print_checkpoint_table(rows, args.repeats)
        if {"checkpoint", "resume"} <= set(args.part):
            print_goodput_table(rows)
    if "plan" in args.part:
        from infra.plan import bench as plan_bench

        plan_bench.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
