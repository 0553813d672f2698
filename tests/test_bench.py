"""make bench's machinery on a tiny state: methods interleaved in a balanced order, every figure
measured for every method, the hashing writer equal to the pieces' sha256 of the bytes torch wrote.
No time is asserted: the figures are only printed by make bench."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from training.ckpt import digest
from training.ckpt.manager import CheckpointManager
from training.trainer import bench
from training import benchorder
from training.ckpt.staging import HashingWriter, save_hashed


def test_methods_run_interleaved_in_the_balanced_order() -> None:
    calls: list[str] = []

    def method(name: str) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            calls.append(name)
            return {"t": float(rep)}
        return run

    out = bench.interleaved({n: method(n) for n in "abcd"}, repeats=3)
    assert calls == [n for rep in range(3) for n in benchorder.order(list("abcd"), rep)]
    assert calls[4:8] == ["b", "c", "a", "d"]  # not the rotation's b c d a: no method keeps its neighbour
    assert out["a"]["t"] == [0.0, 1.0, 2.0]
    calls.clear()
    bench.interleaved({"a": method("a"), "b": method("b")}, repeats=3, settle=lambda: calls.append("sync"))
    assert calls == ["sync", "a", "sync", "b", "sync", "b", "sync", "a", "sync", "a", "sync", "b"]


def test_the_checkpoint_group_settles_the_disk_before_every_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint group syncs the disk before each method, so no method's fsync pays for
    another's unwritten pages."""
    seen: list[object] = []

    def interleaved(methods: object, repeats: int = 3, settle: object = None) -> dict[str, object]:
        seen.append(settle)
        return {}

    monkeypatch.setattr(bench, "interleaved", interleaved)
    monkeypatch.setattr(bench, "Checkpoints", lambda *a: type("C", (), {"close": lambda self: None,
                        "direct": type("D", (), {"supported": True})(),
                        **{f"run_{m}": None for m in ("ours", "inline", "dcp", "memcpy", "raw", "raw_direct")}})())
    monkeypatch.setattr(bench, "Sharded", lambda *a: type("S", (), {"close": lambda self: None, "run": None})())
    monkeypatch.setattr(bench, "_state", lambda width: ({}, None))
    bench._checkpoint_figures(bench.SIZES["~1 GB"], Path("/nonexistent"), 3)
    assert seen == [os.sync]


def test_every_checkpoint_method_reports_its_figures(tmp_path: Path) -> None:
    state, _ = bench._state(64)
    ck = bench.Checkpoints(state, tmp_path / "w", f"file://{tmp_path / 'bucket'}")
    try:
        assert ck.direct.supported  # this folder's file system takes O_DIRECT
        # Every method starts warm, as the memcpy limit does: its buffers exist before any clock.
        warm = dict(ck.ours._stager._buffers)
        assert warm and ck.ours.local_steps() == [0] and list((tmp_path / "w").glob("dcp--1"))
        figures = bench.interleaved({"ours": ck.run_ours, "inline": ck.run_inline, "dcp": ck.run_dcp,
                                     "memcpy": ck.run_memcpy, "raw": ck.run_raw, "raw_direct": ck.run_raw_direct})
    finally:
        ck.close()
    assert set(figures["ours"]) == {"blocked", "durable", "bucket"}
    assert set(figures["dcp"]) == {"blocked", "durable"} and set(figures["raw"]) == {"durable", "copy"}
    assert set(figures["raw_direct"]) == {"durable"} and not list((tmp_path / "w").glob("raw*"))
    assert all(c <= d for c, d in zip(figures["raw"]["copy"], figures["raw"]["durable"]))  # a part of it
    assert all(0 < d <= b for d, b in zip(figures["ours"]["durable"], figures["ours"]["bucket"]))
    assert all(len(v) == bench.REPEATS and min(v) >= 0 for f in figures.values() for v in f.values())
    assert (tmp_path / "bucket" / "ours").is_dir()  # ours really reached the bucket
    buffers = ck.ours._stager._buffers  # the clocked saves allocated none, nor replaced any
    assert set(buffers) == set(warm) and all(buffers[k] is b for k, b in warm.items())


def test_the_sharded_path_starts_warm_and_a_failed_warm_up_leaves_nothing_open(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sharded = bench.Sharded(64, tmp_path / "w", f"file://{tmp_path / 'bucket'}")
    try:
        assert sharded.manager.local_steps() == [0]  # its warm-up checkpoint, before any clock
        assert set(sharded.run(0)) == {"blocked", "durable", "bucket"}
    finally:
        sharded.close()
    closed = []
    monkeypatch.setattr(CheckpointManager, "close", lambda self, timeout=120.0: closed.append(self))
    monkeypatch.setattr(bench.Sharded, "run", lambda self, rep: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        bench.Sharded(64, tmp_path / "w2", f"file://{tmp_path / 'bucket'}")
    assert len(closed) == 1


def _pieces_digest(data: bytes, piece: int, new: Any = blake3.blake3) -> str:
    """blake3_pieces (sha256_pieces with new=hashlib.sha256) computed the plain way: the hash of
    each piece's hash, in order."""
    return str(new(b"".join(new(data[i:i + piece]).digest() for i in range(0, len(data), piece))).hexdigest())


def test_the_pipelined_hash_is_the_hash_of_the_bytes_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces are cut at every PIECE bytes of the file, whatever the writes torch makes, and
    hashed on helper threads while written: the digest must equal the pieces' digest of the
    file on disk, for sizes around the piece boundaries."""
    monkeypatch.setattr(digest, "PIECE", 1 << 16)  # small pieces: many boundaries in a small state
    for numel in (1, (1 << 15) - 3, 1 << 15, (1 << 16) + 5, 300_001):
        weights = torch.arange(numel, dtype=torch.float32)
        state = {"w": weights, "step": numel}
        size, hexdigest = save_hashed(state, tmp_path / f"s{numel}.pt")
        data = (tmp_path / f"s{numel}.pt").read_bytes()
        assert (size, hexdigest) == (len(data), _pieces_digest(data, 1 << 16))
        assert digest.hash_file(tmp_path / f"s{numel}.pt") == hexdigest
        stream = digest.StreamHasher(digest.PIECES)
        for start in range(0, len(data), 7777):  # a download's chunks never line up with the pieces
            stream.update(data[start:start + 7777])
        assert stream.hexdigest() == hexdigest
        older = digest.StreamHasher(digest.SHA256_PIECES)  # format 2's kind, as a download checks it
        older.update(data)
        assert older.hexdigest() == _pieces_digest(data, 1 << 16, hashlib.sha256) != hexdigest
        assert digest.hash_file(tmp_path / f"s{numel}.pt", digest.SHA256_PIECES) == older.hexdigest()
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert torch.equal(loaded["w"], weights)


def test_the_writer_hashes_small_and_straddling_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "PIECE", 64)
    writes = [b"a" * 10, b"b" * 54, b"c" * 200, b"d", b"e" * 63, b"f" * 128, b""]
    with (tmp_path / "f").open("wb") as fh, HashingWriter(fh) as writer:
        for chunk in writes:
            writer.write(chunk)
        fh.flush()
        hexdigest = writer.hexdigest()
    data = b"".join(writes)
    assert (tmp_path / "f").read_bytes() == data and writer.size == len(data)
    assert hexdigest == _pieces_digest(data, 64) == digest.hash_file(tmp_path / "f")


def test_the_resume_figure_runs_the_trainer_of_this_checkout() -> None:
    """The fresh trainer process is started with PYTHONPATH=ROOT: ROOT must be the checkout."""
    from training.trainer import bench_resume

    assert (bench_resume.ROOT / "training" / "trainer" / "train.py").is_file()
    assert (bench_resume.ROOT / "Makefile").is_file()


def test_the_resume_group_interleaves_every_method_on_its_own_copy(tmp_path: Path) -> None:
    """The trainer, the library's two paths and the limit each resume (or read) their own copy of
    a checkpoint written once before the group (the fresh start, the floor under them, resumes
    none); the copies are gone afterwards and the bases stay,
    and no process leaves its local checkpoint folder behind (up to 1 GB each, in the temp folder)."""
    import tempfile

    from tests.training_helpers import MotoServer, storage_env
    from training.trainer.bench_resume import METHODS, ResumeGroup

    def left() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("gts-bench-lib-*")) | set(tmp_path.rglob("gts-bench-lib-*"))

    before = left()
    moto = MotoServer("bench")
    try:
        group = ResumeGroup(64, "bench", storage_env(moto.url), tmp_path)
        group.prepare()
        bases = moto.keys("resume-64/")
        assert any(k.startswith("resume-64/trainer-base/") for k in bases)
        assert any(k.startswith("resume-64/library-base/") for k in bases)
        figures = bench.interleaved(group.methods(), repeats=1)
        assert set(figures) == set(METHODS) == {"limit", "fresh", "trainer", "library", "library_plain"}
        assert all(len(f["resume"]) == 1 and min(f["resume"]) > 0 for f in figures.values())
        assert moto.keys("resume-64/") == bases  # every method's copy deleted, the bases kept
        assert left() == before
    finally:
        moto.stop()


def test_a_limit_slower_than_the_work_it_bounds_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    from training.trainer import bench_tables

    assert bench_tables.limit_suspect([3.0, 3.2, 3.4], [2.0, 2.1, 2.2]).endswith("(the limit's runs: 3.00 3.20 3.40)")
    assert not bench_tables.limit_suspect([1.0, 1.1, 1.2], [2.0, 2.1, 2.2])
    resume = {"limit": {"resume": [2.0, 2.0, 2.0]}, "trainer": {"resume": [2.6, 2.6, 2.6]},
              "library": {"resume": [1.0, 1.0, 1.0]}, "library_plain": {"resume": [4.0, 4.0, 4.0]},
              "fresh": {"resume": [0.8, 0.8, 0.8]}}
    bench_tables.print_checkpoint_table([("~1 GB", 1000.0, resume)])
    printed = [line for line in capsys.readouterr().out.splitlines() if " resume " in line]
    lines = {line.split("resume")[1].strip().split("  ")[0]: line for line in printed if "import+read" in line}
    assert "1.30x" in lines["trainer"] and "2.00x" in lines["library, 3 lines"] and "0.40x" in lines["fresh start, no ckpt"]
    assert "LIMIT SUSPECT" in lines["library, fast path"] and "0.50x" not in lines["library, fast path"]
    # the library beside the same loop started with nothing to resume; a floor slower than it is flagged
    assert [line for line in printed if "fresh start 0.80" in line and "1.25x" in line and "library, fast path" in line]
    resume["fresh"]["resume"] = [1.2, 1.2, 1.2]
    bench_tables.print_checkpoint_table([("~1 GB", 1000.0, resume)])
    floor = [line for line in capsys.readouterr().out.splitlines() if "fresh start 1.20" in line]
    assert floor and "LIMIT SUSPECT" in floor[0] and "0.83x" not in floor[0]



def test_the_limits_copy_is_its_own_row_and_the_durable_rows_stand_beside_the_raw_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The raw limit's copy into the page cache prints as a share of the limit; a figure without it
    (an older run's) prints the rest as before; a flagged limit flags the durable rows only."""
    from training.trainer import bench_tables

    def table(raw: dict[str, list[float]], inline: float) -> dict[str, str]:
        f = {"memcpy": {"blocked": [0.1] * 3}, "raw": raw, "inline": {"blocked": [9.0] * 3, "durable": [inline] * 3},
             "ours": {"blocked": [0.1] * 3, "durable": [1.5] * 3, "bucket": [5.0] * 3},
             "dcp": {"blocked": [0.1] * 3, "durable": [1.0] * 3}}
        bench_tables.print_checkpoint_table([("~1 GB", 1000.0, f)])
        return {line.split("durable")[1].strip().split("  ")[0]: line
                for line in capsys.readouterr().out.splitlines() if " durable " in line}

    rows = table({"durable": [2.0, 2.0, 2.0], "copy": [1.0, 1.6, 1.6]}, 3.0)
    assert "0.80x" in rows["limit: copy, no fsync"] and "0.75x" in rows["ours"]
    rows = table({"durable": [2.0, 2.0, 2.0]}, 3.0)
    assert "limit: copy, no fsync" not in rows and "0.75x" in rows["ours"]
    rows = table({"durable": [4.0, 4.0, 4.0], "copy": [3.0] * 3}, 3.0)  # slower than the in-line save
    assert "LIMIT SUSPECT" in rows["ours"] and "LIMIT SUSPECT" not in rows["limit: copy, no fsync"]

def test_the_durable_target_stands_against_the_faster_limit_that_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """Ours writes around the page cache: the direct limit stands beside the buffered one, and the
    target is read against the faster of the two, unless that one is flagged (slower than a method
    doing the same work and more: ours for the direct limit, the in-line save for the buffered)."""
    from training.trainer import bench_tables

    def targeted(raw: float, direct: float, ours: float = 0.7, inline: float = 3.0) -> tuple[str, list[str]]:
        f = {"memcpy": {"blocked": [0.1] * 3}, "raw": {"durable": [raw] * 3}, "raw_direct": {"durable": [direct] * 3},
             "inline": {"blocked": [9.0] * 3, "durable": [inline] * 3},
             "ours": {"blocked": [0.1] * 3, "durable": [ours] * 3, "bucket": [5.0] * 3},
             "dcp": {"blocked": [0.1] * 3, "durable": [1.0] * 3}}
        bench_tables.print_checkpoint_table([("~1 GB", 1000.0, f)])
        lines = [line for line in capsys.readouterr().out.splitlines() if " durable " in line]
        with_target = [line for line in lines if "<=1.5x" in line]
        assert len(with_target) == 1
        return with_target[0], lines

    line, lines = targeted(raw=2.0, direct=0.5)
    assert "direct+fsync 0.50" in line and "1.40x" in line
    assert any("limit: direct+fsync" in x and "0.25x" in x for x in lines)
    line, _ = targeted(raw=0.5, direct=0.6)  # the page cache was the faster way this run
    assert "write+fsync 0.50" in line and "1.40x" in line
    line, lines = targeted(raw=2.0, direct=0.9)  # the direct limit slower than ours: flagged
    assert "write+fsync 2.00" in line and "0.35x" in line
    assert any("direct+fsync" in x and "LIMIT SUSPECT" in x for x in lines if " ours " in x)
    line, _ = targeted(raw=4.0, direct=0.6)  # the buffered limit slower than the in-line save: flagged
    assert "direct+fsync 0.60" in line and "1.17x" in line


def test_the_direct_limit_writes_the_states_bytes(tmp_path: Path) -> None:
    from training.trainer import bench_limits

    tensors = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 5, dtype=torch.float64)]
    limit = bench_limits.Direct(tensors, tmp_path)
    try:
        assert limit.supported
        assert limit.write(tmp_path / "d") >= 0
    finally:
        limit.close()
    assert (tmp_path / "d").read_bytes() == b"".join(t.numpy().tobytes() for t in tensors)


def test_the_repeats_are_a_setting_of_at_least_three_and_the_table_says_how_many(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench._parse(["--repeats", "7"]).repeats == 7 and bench._parse([]).repeats == bench.REPEATS
    with pytest.raises(SystemExit):
        bench._parse(["--repeats", "2"])
    assert "--repeats 2: at least 3" in capsys.readouterr().err
    from training.trainer.bench_tables import print_checkpoint_table

    print_checkpoint_table([], 7)
    assert "min/median of 7, interleaved" in capsys.readouterr().out


def test_a_resume_figure_stops_at_its_line_not_at_the_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each resume method is timed to a line it prints, never to its exit (torch's and boto3's
    teardown is 0.3-0.6 s no figure holds; the limit was once timed to its exit and the rest to
    their line). The child below exits only once the clock has been read at its line (a file the
    fake clock makes); a process that exits non-zero after the line has no figure."""
    import sys

    from training.trainer import bench_resume

    marker = tmp_path / "clock-read"
    readings: list[float] = []

    def clock() -> float:
        if readings:
            marker.touch()
        readings.append(float(len(readings)))
        return readings[-1]

    monkeypatch.setattr(bench_resume, "time", type("Clock", (), {"perf_counter": staticmethod(clock)}))
    child = ("import pathlib, sys, time\nprint('warming', flush=True)\nprint('read 5 bytes', flush=True)\n"
             "deadline = time.monotonic() + 120\n"
             "while not pathlib.Path(sys.argv[1]).exists():\n"
             "    if time.monotonic() > deadline: sys.exit(3)\n"
             "    time.sleep(0.01)\n"
             "sys.exit(int(sys.argv[2]))\n")
    env = dict(os.environ)
    assert bench_resume._timed([sys.executable, "-c", child, str(marker), "0"], tmp_path, env,
                               r"^read \d+ bytes$", None) == 1.0
    marker.unlink()
    readings.clear()
    with pytest.raises(RuntimeError, match="exited 4"):
        bench_resume._timed([sys.executable, "-c", child, str(marker), "4"], tmp_path, env, r"^read \d+ bytes$", None)
    # a line before "resumed from step" does not stop the clock
    readings.clear()
    with pytest.raises(RuntimeError, match="without reaching"):
        bench_resume._timed([sys.executable, "-c", "print('step 2 loss 1.0')"], tmp_path, env, r"step 2 loss")


@pytest.mark.parametrize("child", [
    "import threading; threading.Event().wait()",  # prints nothing, never exits
    # its line, then its output closed and a child of its own holding it open (a hang after the line)
    "import os, subprocess, sys, threading; print('read 5 bytes', flush=True); "
    "subprocess.Popen([sys.executable, '-c', 'import threading; threading.Event().wait()']); "
    "os.close(1); os.close(2); threading.Event().wait()",
])
def test_a_resume_method_that_never_exits_is_killed_and_has_no_figure(tmp_path: Path, child: str) -> None:
    import sys

    from training.trainer import bench_resume

    with pytest.raises(RuntimeError, match="was killed after 1 s"):
        bench_resume._timed([sys.executable, "-c", child], tmp_path, dict(os.environ), r"^read \d+ bytes$", None,
                            timeout_s=1.0)
