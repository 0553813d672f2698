"""make bench's machinery on a tiny state: methods interleaved in rotated order, every figure
measured for every method, the hashing writer equal to a plain sha256 of the bytes torch wrote.
No time is asserted: the figures are only printed by make bench."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from pathlib import Path

import torch

from training.trainer import bench
from training.staging import HashingWriter, save_hashed


def test_methods_run_interleaved_in_rotated_order() -> None:
    calls: list[str] = []

    def method(name: str) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            calls.append(name)
            return {"t": float(rep)}
        return run

    out = bench.interleaved({"a": method("a"), "b": method("b"), "c": method("c")}, repeats=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert out["a"]["t"] == [0.0, 1.0, 2.0]


def test_every_checkpoint_method_reports_its_figures(tmp_path: Path) -> None:
    state, _ = bench._state(64)
    ck = bench.Checkpoints(state, tmp_path / "w", f"file://{tmp_path / 'bucket'}")
    try:
        figures = bench.interleaved({"ours": ck.run_ours, "inline": ck.run_inline, "dcp": ck.run_dcp,
                                     "memcpy": ck.run_memcpy, "raw": ck.run_raw})
    finally:
        ck.close()
    assert set(figures["ours"]) == {"blocked", "durable", "bucket"}
    assert set(figures["dcp"]) == {"blocked", "durable"} and set(figures["raw"]) == {"durable"}
    assert all(len(v) == bench.REPEATS and min(v) >= 0 for f in figures.values() for v in f.values())
    assert (tmp_path / "bucket" / "ours").is_dir()  # ours really reached the bucket


def test_the_pipelined_hash_is_the_hash_of_the_bytes_written(tmp_path: Path) -> None:
    """Large writes are hashed piecewise on a helper thread while written: the digest must equal
    sha256 of the file, for sizes around the piece boundaries."""
    HashingWriter.PIECE = 1 << 16  # small pieces: many boundaries in a small state
    try:
        for numel in (1, (1 << 15) - 3, 1 << 15, (1 << 16) + 5, 300_001):
            weights = torch.arange(numel, dtype=torch.float32)
            state = {"w": weights, "step": numel}
            size, digest = save_hashed(state, tmp_path / f"s{numel}.pt")
            data = (tmp_path / f"s{numel}.pt").read_bytes()
            assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            assert torch.equal(loaded["w"], weights)
    finally:
        HashingWriter.PIECE = 8 << 20
