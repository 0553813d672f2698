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
    a checkpoint written once before the group; the copies are gone afterwards and the bases stay,
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
        assert set(figures) == set(METHODS) == {"limit", "trainer", "library", "library_plain"}
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
              "library": {"resume": [1.0, 1.0, 1.0]}, "library_plain": {"resume": [4.0, 4.0, 4.0]}}
    bench_tables.print_checkpoint_table([("~1 GB", 1000.0, resume)])
    lines = {line.split("resume")[1].strip().split("  ")[0]: line for line in capsys.readouterr().out.splitlines()
             if " resume " in line}
    assert "1.30x" in lines["trainer"] and "2.00x" in lines["library, 3 lines"]
    assert "LIMIT SUSPECT" in lines["library, fast path"] and "0.50x" not in lines["library, fast path"]



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


def test_the_plan_group_scales_the_stack_and_balances_every_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-resource figure plans the stack at 2x its node groups (copies renamed, in a scratch
    folder) and fits slopes; every run of the group is interleaved in benchorder's order."""
    import yaml

    from infra.plan import bench as plan_bench

    name = plan_bench.scaled_stack("dev", 2, tmp_path)
    key = "gpu-training-stack:nodeGroups"
    groups = yaml.safe_load((plan_bench.ROOT / "Pulumi.dev.yaml").read_text())["config"][key]
    doubled = yaml.safe_load((tmp_path / f"Pulumi.{name}.yaml").read_text())["config"][key]
    names = [g["name"] for g in doubled]
    assert len(doubled) == 2 * len(groups) and len(set(names)) == len(names)
    assert len(plan_bench._plan(name, tmp_path)) > len(plan_bench._plan("dev", plan_bench.ROOT))
    assert plan_bench.slope([(100, 1.0), (200, 1.5), (400, 2.5)]) == pytest.approx(0.005)

    order: list[str] = []
    runs = {n: ([n], plan_bench.ROOT) for n in ("plan@1", "plan@2", "floor@1", "floor@2", "floor_gc@1", "imports")}
    monkeypatch.setattr(plan_bench, "_runs", lambda *a: (runs, {1: 10, 2: 20}, [], []))
    def timed(cmd: list[str], cwd: Path) -> tuple[float, float | None]:
        order.append(cmd[0])
        return 1.0, (None if cmd[0] == "imports" else 0.5)

    monkeypatch.setattr(plan_bench, "_timed", timed)
    found = plan_bench.measure("dev", 3, (1, 2))
    assert order == [n for rep in range(3) for n in benchorder.order(list(runs), rep)]
    assert order[:6] == ["plan@1", "plan@2", "imports", "floor@1", "floor_gc@1", "floor@2"]
    assert all(len(v) == 3 for v in found["times"].values())  # type: ignore[attr-defined]
    work = found["work"]
    assert isinstance(work, dict) and work["imports"] == [] and all(len(work[n]) == 3 for n in runs if n != "imports")


def test_the_replay_floor_registers_the_plans_own_resources(tmp_path: Path) -> None:
    """The second limit of the plan group re-registers, at each scale, exactly the resources the
    plan registered (same count, same types), untyped, through the same engine; it is run with
    the other commands of the group."""
    import json
    import subprocess

    from infra.plan import bench as plan_bench

    runs, counts, sdks, imported = plan_bench._runs("dev", [1, 2], tmp_path)
    assert {"replay@1", "replay@2", "floor@1", "floor@2", "plan@1", "plan@2"} <= set(runs)
    # the floors import the SDK modules of the provider functions the plan calls as well as its
    # resources' (dev calls some: the caller's identity, Tencent's image lookup)
    types = {r["type"] for s in (1, 2) for r in json.loads((tmp_path / f"replay-{s}.json").read_text())}
    from_invokes = set(sdks) - set(plan_bench.sdk_modules(types))
    assert from_invokes and all(m in imported or "." not in m for m in from_invokes)
    for scale, key in ((1, "replay"), (2, "replay"), (1, "typed"), (2, "typed")):
        cmd, cwd = runs[f"{key}@{scale}"]
        resources = json.loads((tmp_path / f"replay-{scale}.json").read_text())
        assert len(resources) == counts[scale] and {r["type"] for r in resources} >= {"aws:ec2/vpc:Vpc"}
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=plan_bench._env(), timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert int(done.stdout.split()[-1]) == counts[scale]
    assert counts[2] > counts[1]
    for name in ("plan@1", "floor@1", "replay@2"):  # each times its own work after the SDK imports
        wall, work = plan_bench._timed(*runs[name])
        assert work is not None and 0 < work < wall, name


def test_the_plan_report_gives_every_limit_per_resource(capsys: pytest.CaptureFixture[str]) -> None:
    from infra.plan import bench as plan_bench

    times = {"plan@1": [9.0] * 3, "plan@2": [9.0] * 3, "floor@1": [5.0] * 3, "floor@2": [5.0] * 3,
             "replay@1": [6.0] * 3, "replay@2": [6.0] * 3, "typed@1": [8.0] * 3, "typed@2": [8.0] * 3,
             "floor_gc@1": [6.0] * 3, "imports": [4.0] * 3}
    # the slopes come from the work each process timed after its imports, not the process times
    work = {"plan@1": [2.0] * 3, "plan@2": [3.0] * 3, "floor@1": [1.0] * 3, "floor@2": [1.0] * 3,
            "replay@1": [1.5] * 3, "replay@2": [2.0] * 3, "typed@1": [1.6] * 3, "typed@2": [2.4] * 3,
            "floor_gc@1": [1.2] * 3, "imports": []}
    plan_bench._report({"stack": "dev", "resources": {1: 100, 2: 200}, "times": times, "work": work, "extra": []})
    lines = [line for line in capsys.readouterr().out.splitlines() if "per resource" in line]
    assert len(lines) == 3
    assert "LIMIT SUSPECT" in lines[0] and "x   target" not in lines[0]  # the trivial floor did not grow
    assert "replay floor 5.00 ms" in lines[1] and " 2.00x" in lines[1] and "target" not in lines[1]
    assert "typed floor 8.00 ms" in lines[2] and " 1.25x" in lines[2] and "what the program adds" in lines[2]


def test_a_floor_that_fails_is_never_a_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 1 is the plan's policy verdict after its work; exit 1 before any work (a floor's
    SystemExit) or any other exit fails the bench, naming the run."""
    import subprocess

    from infra.plan import bench as plan_bench

    def run(rc: int, stderr: bytes) -> Callable[..., subprocess.CompletedProcess[bytes]]:
        return lambda cmd, **kw: subprocess.CompletedProcess(cmd, rc, b"", stderr)

    monkeypatch.setattr(subprocess, "run", run(1, b"violations\nGTS_WORK_S=0.5\n"))
    assert plan_bench._timed(["python", "-c", "plan"])[1] == 0.5
    for rc, err in ((1, b"typed floor: aws:ec2/vpc:Vpc has no argument for input 'x'\n"), (2, b"GTS_WORK_S=0.5\n")):
        monkeypatch.setattr(subprocess, "run", run(rc, err))
        with pytest.raises(RuntimeError, match=f"python -c floor failed \\({rc}\\)"):
            plan_bench._timed(["python", "-c", "floor"])

@pytest.mark.parametrize("stack", ["dev", "prod", "team-vision"])
def test_the_typed_floor_registers_the_plans_inputs_through_the_sdks_classes(stack: str) -> None:
    """The typed floor builds each resource through its type's SDK class with the plan's recorded
    inputs: the engine records exactly the plan's inputs again (a declared secret wrapped), and a
    recorded input the class has no argument for stops it, named (no input is dropped)."""
    import contextlib
    import io
    import json

    import pulumi_aws

    from infra.plan import bench as plan_bench
    from infra.plan.__main__ import main
    from infra.plan.engine import run_program
    from infra.stack.stackfile import StackConfig

    def unwrapped(value: object) -> object:
        if isinstance(value, dict):
            secret = "4dabf18193072939515e22adb298388d"
            return unwrapped(value["value"]) if secret in value else {k: unwrapped(v) for k, v in value.items()}
        return [unwrapped(v) for v in value] if isinstance(value, list) else value

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--stack", stack, "--format", "json"])
    resources = json.loads(out.getvalue())["resources"]
    config = StackConfig(project="bench", stack="bench", values={}, secret_keys=[])
    got = {(g.type, g.name): g for g in run_program(config, {}, program=plan_bench.replay_program(resources, True))}
    assert len(got) == len(resources)
    for r in resources:
        assert unwrapped(json.loads(json.dumps(got[(r["type"], r["name"])].inputs))) == r["inputs"], r["name"]
    found = plan_bench.sdk_class("aws:ec2/vpc:Vpc")
    assert found is not None and found[0] is pulumi_aws.ec2.Vpc and "cidr_block" in found[1]
    assert plan_bench.sdk_class("pulumi:providers:aws") is None
    vpc = next(r for r in resources if r["type"] == "aws:ec2/vpc:Vpc")
    hostile = [dict(vpc, inputs={**vpc["inputs"], "noSuchArgument": 1})]
    with pytest.raises(SystemExit, match="aws:ec2/vpc:Vpc has no argument for input 'noSuchArgument'"):
        plan_bench.replay_program(hostile, True)
    for own in ("resourceName", "opts"):  # the constructor's own parameters are no input's
        with pytest.raises(SystemExit, match=f"no argument for input '{own}'"):
            plan_bench.replay_program([dict(vpc, inputs={**vpc["inputs"], own: "x"})], True)


def test_the_repeats_are_a_setting_of_at_least_three_and_the_table_says_how_many(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench._parse(["--repeats", "7"]).repeats == 7 and bench._parse([]).repeats == bench.REPEATS
    with pytest.raises(SystemExit):
        bench._parse(["--repeats", "2"])
    assert "--repeats 2: at least 3" in capsys.readouterr().err
    from training.trainer.bench_tables import print_checkpoint_table

    print_checkpoint_table([], 7)
    assert "min/median of 7, interleaved" in capsys.readouterr().out
