"""training/ckpt/direct.py: a checkpoint written around the page cache holds exactly the bytes
written, in any pieces, with flushes between them; a file system or device that refuses O_DIRECT
gets the same bytes through the page cache; any other error reaches the caller."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from training.ckpt import digest, direct
from training.ckpt.staging import save_hashed

ALIGN = direct.ALIGN


@pytest.fixture
def small_chunk(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(direct, "CHUNK", 4 * ALIGN)  # many whole buffers in a small file
    return direct.CHUNK


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(n))


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore(2) on a mapping of it)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    with path.open("r+b") as fh:
        mapped = mmap.mmap(fh.fileno(), size)  # mapping touches no page: mincore sees the page cache
        anchor = ctypes.c_char.from_buffer(mapped)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, vec)
        del anchor
        mapped.close()
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw)


def test_any_pieces_and_flushes_give_exactly_the_bytes(tmp_path: Path, small_chunk: int) -> None:
    sizes = [1, 63, small_chunk - 64, 3 * small_chunk + 5, 0, ALIGN, small_chunk, 7]
    for flush_every in (0, 1, 3):
        path = tmp_path / f"f{flush_every}"
        written = b""
        with direct.DirectFile(path) as fh:
            for i, n in enumerate(sizes):
                data = _pattern(n, i)
                assert fh.write(memoryview(data)) == n
                written += data
                if flush_every and i % flush_every == 0:  # a flush in the middle: the tail block is rewritten later
                    fh.flush()
                    assert path.stat().st_size == len(written)
            assert fh.direct == direct.usable(tmp_path)  # ext4 here: direct (the fallbacks are tested below)
        assert path.read_bytes() == written and fh.size == len(written)


def test_a_reused_buffer_leaves_no_old_bytes_in_the_padding(tmp_path: Path, small_chunk: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The last block goes out padded; until the truncate (or if it never comes: a crash) the
    padding is zeros, not the bytes of the file the buffer held before."""
    with direct.DirectFile(tmp_path / "a") as fh:
        fh.write(b"\xff" * (small_chunk - 1))
    truncated: list[int] = []
    monkeypatch.setattr("training.ckpt.direct.os.ftruncate", lambda fd, size: truncated.append(size))
    with direct.DirectFile(tmp_path / "b") as fh:  # the same buffer, full of 0xff: only 10 bytes are new
        fh.write(b"x" * 10)
    assert truncated and set(truncated) == {10}
    assert (tmp_path / "b").read_bytes() == b"x" * 10 + bytes(ALIGN - 10)


def test_the_checkpoint_bytes_skip_the_page_cache(tmp_path: Path) -> None:
    """The point of the writer: a checkpoint's pages are not copied into the page cache (the
    copy that costs most on these VMs). A buffered write of the same bytes leaves them there."""
    if not direct.usable(tmp_path):
        pytest.skip(f"{tmp_path} is on {direct.filesystem(tmp_path) or 'an unknown file system'}: no O_DIRECT")
    data = _pattern(64 * ALIGN, 1)
    with direct.DirectFile(tmp_path / "direct") as fh:
        fh.write(data)
    with (tmp_path / "buffered").open("wb") as plain:
        plain.write(data)
    assert _resident_pages(tmp_path / "buffered") == 64
    assert _resident_pages(tmp_path / "direct") <= 1  # at most the truncated tail's block


def test_a_file_system_without_o_direct_gets_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             small_chunk: int) -> None:
    real_open = os.open

    def refusing(path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr("training.ckpt.direct.os.open", refusing)
    data = _pattern(2 * small_chunk + 17, 2)
    with direct.DirectFile(tmp_path / "f") as fh:
        fh.write(data)
        assert not fh.direct
    assert (tmp_path / "f").read_bytes() == data


def test_a_device_that_refuses_the_alignment_gets_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 small_chunk: int) -> None:
    real_pwrite = os.pwrite
    refused: list[int] = []

    def picky(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= small_chunk:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", picky)
    data = _pattern(3 * small_chunk + 5, 3)
    with direct.DirectFile(tmp_path / "f") as fh:
        fh.write(data)
        assert not fh.direct and not fcntl.fcntl(fh.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    assert refused == [small_chunk]  # refused once, then written through the page cache
    assert (tmp_path / "f").read_bytes() == data


def test_a_full_disk_reaches_the_caller_and_the_buffer_goes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 small_chunk: int) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", full)
    monkeypatch.setattr(direct, "_spare", [])
    fh = direct.DirectFile(tmp_path / "f")
    with pytest.raises(OSError) as caught:
        fh.write(b"x" * small_chunk)
    assert caught.value.errno == errno.ENOSPC
    fh.close()  # a failed file is not flushed again: the caller discards it
    assert fh.closed and len(direct._spare) == 1
    with pytest.raises(OSError):
        os.fstat(fh.fileno())  # the descriptor is closed


def test_a_checkpoint_saved_through_it_loads_and_hashes(tmp_path: Path, small_chunk: int) -> None:
    """save_hashed writes through DirectFile: the file loads, its hash is what the writer said."""
    weights = torch.arange(3 * small_chunk // 4 + 11, dtype=torch.float32)
    size, hexdigest = save_hashed({"w": weights, "step": 7}, tmp_path / "model.pt")
    assert size == (tmp_path / "model.pt").stat().st_size
    if direct.usable(tmp_path):  # the checkpoint went around the page cache (before anything reads it)
        assert _resident_pages(tmp_path / "model.pt") <= 1
    assert digest.hash_file(tmp_path / "model.pt") == hexdigest
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(loaded["w"], weights) and loaded["step"] == 7
    assert not (tmp_path / "model.pt.part").exists()


def test_the_folders_file_system_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_chunk: int) -> None:
    """The file system is read as findmnt(8) reads it; on one that is not a local block file system
    (NFS: every O_DIRECT write would wait for the server) the same bytes go through the page cache."""
    import shutil
    import subprocess

    if shutil.which("findmnt"):
        found = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(tmp_path)], capture_output=True, text=True)
        assert direct.filesystem(tmp_path) == found.stdout.strip()
    monkeypatch.setattr(direct, "filesystem", lambda folder: "nfs4")
    data = _pattern(small_chunk + 5, 4)
    with direct.DirectFile(tmp_path / "f") as fh:
        fh.write(data)
        assert not fh.direct and not fcntl.fcntl(fh.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    assert (tmp_path / "f").read_bytes() == data and not direct.usable(tmp_path)


def test_a_flush_with_nothing_new_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 small_chunk: int) -> None:
    """save_hashed flushes, fsyncs, then closes the hashing writer and the file, each of which
    flushes again: the tail is written once, not again after the fsync."""
    real_pwrite = os.pwrite
    offsets: list[int] = []

    def counted(fd: int, data: Any, offset: int) -> int:
        offsets.append(offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", counted)
    save_hashed({"w": torch.arange(small_chunk // 2, dtype=torch.float32)}, tmp_path / "model.pt")
    assert offsets == sorted(set(offsets))  # every block written once, in order
    offsets.clear()
    with direct.DirectFile(tmp_path / "f") as fh:
        fh.write(b"a" * 10)
        fh.flush()
        fh.flush()
        fh.write(b"b" * 10)  # new bytes after a flush: the tail block again, once
    assert offsets == [0, 0] and (tmp_path / "f").read_bytes() == b"a" * 10 + b"b" * 10


def test_a_failed_write_is_not_tried_again_by_the_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         small_chunk: int) -> None:
    real_pwrite = os.pwrite
    tries: list[int] = []

    def full_after_one(fd: int, data: Any, offset: int) -> int:
        tries.append(offset)
        if offset >= small_chunk:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", full_after_one)
    with pytest.raises((OSError, RuntimeError)) as caught:  # torch reports its writer's error as its own
        save_hashed({"w": torch.zeros(small_chunk, dtype=torch.uint8)}, tmp_path / "model.pt")
    chain = [caught.value, caught.value.__cause__, caught.value.__context__]
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    assert tries.count(small_chunk) == 1 and not (tmp_path / "model.pt").exists()


def test_a_close_that_fails_gives_the_buffer_back_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close(2) can fail after freeing the descriptor (EIO on a network file system): the file is
    closed all the same, its buffer is back in the pool once, and a second close touches nothing
    (the descriptor's number may already be another file's)."""
    real_close = os.close
    failures: list[int] = []

    def close_then_fail(fd: int) -> None:
        real_close(fd)
        if not failures:
            failures.append(fd)
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(direct, "_spare", [])
    fh = direct.DirectFile(tmp_path / "f")
    fh.write(b"x")
    monkeypatch.setattr("training.ckpt.direct.os.close", close_then_fail)
    with pytest.raises(OSError):
        fh.close()
    other = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT, 0o600)  # may take the freed number
    try:
        fh.close()
        os.fstat(other)  # still open
    finally:
        real_close(other)
    assert fh.closed and len(direct._spare) == 1 and failures
    a, b = direct.DirectFile(tmp_path / "a"), direct.DirectFile(tmp_path / "b")
    try:
        assert a._buffer is not b._buffer
    finally:
        a.close()
        b.close()
