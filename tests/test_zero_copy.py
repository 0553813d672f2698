"""training/ckpt/direct.py's zero-copy writes: a staged tensor's memory starts on a page, torch.save
places its storage on a page of the file, and the writer hands that memory to the disk without
copying it into its buffer. The file is byte for byte what torch.save writes with the same
options, whichever way each piece went; anything unaligned goes through the buffer."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from training.ckpt import digest, direct, staging
from training.ckpt.staging import Stager, save_hashed

ALIGN = direct.ALIGN
BIG = direct.ZERO_COPY_MIN


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Every block write of the DirectFiles: (offset, length, straight from the caller's memory)."""
    seen: list[tuple[int, int, bool]] = []
    real = direct.DirectFile._write_at

    def spy(self: direct.DirectFile, offset: int, length: int, source: memoryview | None = None, head: int = 0) -> None:
        if head:
            seen.append((offset, head, False))  # the buffer's bytes, in the same call
        seen.append((offset + head, length, source is not None))
        real(self, offset, length, source, head)

    monkeypatch.setattr(direct.DirectFile, "_write_at", spy)
    return seen


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(BIG // 4 + 3),  # a tail that is not a whole block
        "bias": torch.randn(5),  # small: between two large storages
        "mask": torch.rand(BIG + ALIGN) > 0.5,
        "half": torch.randn(BIG // 2, dtype=torch.bfloat16),
        "step": 11,
    }


def _expected(state: Any, aligned: bool = True) -> bytes:
    with staging._serialiser_options(aligned):
        out = io.BytesIO()
        torch.save(state, out)
    return out.getvalue()


def test_a_staged_buffer_starts_on_a_page_and_is_exactly_its_bytes() -> None:
    for shape, dtype in (((BIG // 4,), torch.float32), ((3, BIG), torch.bool), ((BIG // 2 + 1,), torch.bfloat16)):
        t = direct.aligned_empty(torch.Size(shape), dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # torch.save writes the storage
        t.fill_(1)
        assert bool(t.all())
    small = direct.aligned_empty(torch.Size((7,)), torch.float32)
    assert small.shape == (7,) and small.untyped_storage().nbytes() == 28


def test_a_staged_checkpoint_goes_to_the_disk_without_the_copy(tmp_path: Path,
                                                               writes: list[tuple[int, int, bool]]) -> None:
    if not direct.usable(tmp_path):
        pytest.skip(f"{tmp_path} is on {direct.filesystem(tmp_path) or 'an unknown file system'}: no O_DIRECT")
    state = _state()
    staged = Stager().stage(state)
    size, hexdigest = save_hashed(staged, tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    assert data == _expected(state) and size == len(data)
    assert digest.hash_file(tmp_path / "model.pt") == hexdigest
    zero_copied = sum(length for _, length, straight in writes if straight)
    large = [t for t in staged.values() if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= BIG]
    assert zero_copied == sum(t.numel() * t.element_size() // ALIGN * ALIGN for t in large)
    offsets = [offset for offset, _, _ in writes]
    assert offsets == sorted(offsets) and all(o % ALIGN == 0 for o in offsets)
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in ("w", "bias", "mask", "half")) and loaded["step"] == 11


def test_each_storage_carries_the_records_before_it_in_one_write(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A small O_DIRECT write is a request the device completes before the call returns: the
    buffered records before a large storage go out in the storage's own write (pwritev), so the
    file takes one write per large storage and one for the rest, not one more for each storage's
    records. The file is still exactly torch.save's."""
    if not direct.usable(tmp_path):
        pytest.skip("no O_DIRECT here")
    calls: list[tuple[str, int]] = []
    real, real_v = os.pwrite, os.pwritev

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(("pwrite", len(memoryview(data))))
        return real(fd, data, offset)

    def pwritev(fd: int, parts: list[Any], offset: int) -> int:
        calls.append(("pwritev", len(parts)))
        return real_v(fd, parts, offset)

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", pwrite)
    monkeypatch.setattr("training.ckpt.direct.os.pwritev", pwritev)
    state = _state()  # three large storages, each after records (and the one before's tail)
    save_hashed(Stager().stage(state), tmp_path / "model.pt")
    assert (tmp_path / "model.pt").read_bytes() == _expected(state)
    assert calls[:3] == [("pwritev", 2)] * 3  # records + storage, three times
    assert [kind for kind, _ in calls[3:]] == ["pwrite"]  # the last records, padded to a block


def test_the_serialiser_options_are_restored_whatever_happens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = torch.utils.serialization.config.save
    before = (config.storage_alignment, torch.serialization.get_crc32_options())
    save_hashed({"w": torch.zeros(3)}, tmp_path / "a.pt")
    assert (config.storage_alignment, torch.serialization.get_crc32_options()) == before

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", full)
    with pytest.raises((OSError, RuntimeError)) as caught:  # torch reports its writer's error as its own
        save_hashed(Stager().stage(_state()), tmp_path / "b.pt")
    chain = [caught.value, caught.value.__cause__, caught.value.__context__]
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    assert (config.storage_alignment, torch.serialization.get_crc32_options()) == before
    assert not (tmp_path / "b.pt").exists()  # not renamed into place: the caller discards the .part


def test_unaligned_memory_or_positions_go_through_the_buffer(tmp_path: Path,
                                                             writes: list[tuple[int, int, bool]]) -> None:
    """Header bytes, a flush between them, then large writes: aligned memory at an aligned position
    goes straight out (after the buffered bytes before it); memory off a page, or a position off a
    block, is copied. Every way gives exactly the bytes written."""
    if not direct.usable(tmp_path):
        pytest.skip("no O_DIRECT here")
    page = direct.aligned_empty(torch.Size((2 * BIG + ALIGN,)), torch.uint8)
    page.copy_(torch.arange(page.numel()) % 251)
    pieces = [b"h" * 100, b"p" * (ALIGN - 100),  # a header, padded to a block: the position is aligned
              page[:BIG + 10], b"q" * (ALIGN - 10),  # straight out but its tail; padding to a block
              page[8:BIG + 8],  # memory off a page: copied
              b"r" * 3, page[:BIG]]  # a position off a block: copied
    expected = bytearray()
    with direct.DirectFile(tmp_path / "f") as fh:
        for i, piece in enumerate(pieces):
            view = memoryview(piece.numpy()) if isinstance(piece, torch.Tensor) else memoryview(piece)  # type: ignore[arg-type]
            fh.write(view)
            expected += view.tobytes()
            if i == 1:
                fh.flush()  # the header's block is on the disk padded; it goes again, whole
    assert (tmp_path / "f").read_bytes() == expected
    straight = [(offset, length) for offset, length, s in writes if s]
    assert straight == [(ALIGN, BIG)]
    assert os.path.getsize(tmp_path / "f") == len(expected)


def test_many_small_tensors_keep_torchs_alignment(tmp_path: Path) -> None:
    """Padding every record to a block would grow a file of many small tensors by a block each:
    such a state keeps torch's 64 bytes (the same file torch.save writes without the CRC)."""
    many = {f"t{i}": torch.full((256,), float(i)) for i in range(64)}  # 1 KiB each
    size, _ = save_hashed(many, tmp_path / "many.pt")
    assert (tmp_path / "many.pt").read_bytes() == _expected(many, aligned=False)
    assert size < 2 * 64 * 1024  # the tensors (64 KiB) and the zip's records; a block a tensor would be 256 KiB
    few = {"w": torch.zeros(BIG), "b": torch.zeros(3)}  # 4 MiB: 8 records' padding is 1/128 of it
    save_hashed(few, tmp_path / "few.pt")
    assert (tmp_path / "few.pt").read_bytes() == _expected(few, aligned=True) != _expected(few, aligned=False)
