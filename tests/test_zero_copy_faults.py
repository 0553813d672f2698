"""The zero-copy path's faults (training/ckpt/direct.py, staging.py): a device that cannot read the
caller's memory (EFAULT) or refuses the alignment (EINVAL) gets the same bytes another way; a full
disk fails the save; memory the kernel will not map comes from torch.empty; torch's serialiser
settings come back whatever happens and two saves at once cannot leave them changed; torch's
one warning cannot reach a program that makes warnings errors."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from training.ckpt import direct, staging
from training.ckpt.staging import Stager, save_hashed

ALIGN = direct.ALIGN
BIG = direct.ZERO_COPY_MIN
ROOT = Path(__file__).resolve().parents[1]


def _state() -> dict[str, Any]:
    torch.manual_seed(1)
    return {"a": torch.randn(BIG // 2 + 1), "b": torch.randn(7), "c": torch.randn(BIG // 4), "step": 3}


def _expected(state: Any, aligned: bool) -> bytes:
    import io

    with staging._serialiser_options(aligned):
        out = io.BytesIO()
        torch.save(state, out)
    return out.getvalue()


def _refusing_caller_memory(monkeypatch: pytest.MonkeyPatch, code: int) -> list[int]:
    """os.pwrite and os.pwritev refuse (with `code`) any O_DIRECT write of more than the writer's
    buffer holds (only the caller's memory is written in such pieces); returns the offsets refused."""
    real, real_v = os.pwrite, os.pwritev
    refused: list[int] = []

    def refuse(fd: int, parts: list[Any], offset: int) -> None:
        if any(len(memoryview(p)) > direct.CHUNK for p in parts) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(code, os.strerror(code))

    def picky(fd: int, data: Any, offset: int) -> int:
        refuse(fd, [data], offset)
        return real(fd, data, offset)

    def picky_v(fd: int, parts: list[Any], offset: int) -> int:  # a storage's write carrying the records before it
        refuse(fd, parts, offset)
        return real_v(fd, parts, offset)

    monkeypatch.setattr("training.ckpt.direct.os.pwrite", picky)
    monkeypatch.setattr("training.ckpt.direct.os.pwritev", picky_v)
    return refused


@pytest.fixture
def direct_here(tmp_path: Path) -> Path:
    if not direct.usable(tmp_path):
        pytest.skip(f"{tmp_path} is on {direct.filesystem(tmp_path) or 'an unknown file system'}: no O_DIRECT")
    return tmp_path


def test_memory_the_device_cannot_read_goes_through_the_buffer(direct_here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "CHUNK", 64 * 1024)
    refused = _refusing_caller_memory(monkeypatch, errno.EFAULT)
    state = _state()
    save_hashed(Stager().stage(state), direct_here / "m.pt")
    assert len(refused) == 1  # the first storage; the file's others went through the buffer at once
    assert (direct_here / "m.pt").read_bytes() == _expected(state, aligned=True)


def test_an_alignment_the_device_refuses_goes_through_the_page_cache(direct_here: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "CHUNK", 64 * 1024)
    refused = _refusing_caller_memory(monkeypatch, errno.EINVAL)
    state = _state()
    save_hashed(Stager().stage(state), direct_here / "m.pt")
    assert len(refused) == 1
    assert (direct_here / "m.pt").read_bytes() == _expected(state, aligned=True)


def test_a_full_disk_in_a_zero_copy_write_fails_the_save(direct_here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "CHUNK", 64 * 1024)
    refused = _refusing_caller_memory(monkeypatch, errno.ENOSPC)
    with pytest.raises((OSError, RuntimeError)) as caught:
        save_hashed(Stager().stage(_state()), direct_here / "m.pt")
    chain = [caught.value, caught.value.__cause__, caught.value.__context__]
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    assert len(refused) == 1 and not (direct_here / "m.pt").exists()


def test_a_failed_write_s_traceback_does_not_keep_the_writers_buffer(direct_here: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The error of a failed write lives on (the caller's handler, a future) with its traceback:
    no frame of it may hold a view of the writer's buffer, or the buffer stays mapped after the
    writer gives it up (close() refuses while a view is exported)."""
    monkeypatch.setattr(direct, "CHUNK", 64 * 1024)
    monkeypatch.setattr(direct, "KEEP", 0)  # every buffer given up is unmapped at once
    monkeypatch.setattr(direct, "_spare", [])
    _refusing_caller_memory(monkeypatch, errno.ENOSPC)
    unmapped: list[bool] = []
    discard = direct._discard

    def watched(buffer: mmap.mmap) -> None:
        discard(buffer)
        unmapped.append(buffer.closed)

    monkeypatch.setattr(direct, "_discard", watched)
    with pytest.raises((OSError, RuntimeError)) as caught:
        save_hashed(Stager().stage(_state()), direct_here / "m.pt")
    assert caught.value.__traceback__ is not None  # still held here, as a handler would hold it
    assert unmapped == [True]


def test_memory_the_kernel_will_not_map_comes_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_more(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")  # vm.max_map_count reached

    monkeypatch.setattr(mmap, "mmap", no_more)
    staged = Stager().stage({"w": torch.ones(BIG)})
    assert torch.equal(staged["w"], torch.ones(BIG))
    monkeypatch.undo()

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("unsupported dtype")  # torch's refusal of a buffer or dtype

    monkeypatch.setattr(torch, "frombuffer", refused)
    assert torch.equal(direct.aligned_empty(torch.Size((BIG,)), torch.float32).fill_(2), torch.full((BIG,), 2.0))


def test_a_file_system_without_o_direct_gets_no_padding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the writer goes through the page cache (NFS here) the padding would buy nothing."""
    monkeypatch.setattr(direct, "filesystem", lambda folder: "nfs4")
    state = _state()
    save_hashed(Stager().stage(state), tmp_path / "m.pt")
    assert (tmp_path / "m.pt").read_bytes() == _expected(state, aligned=False) != _expected(state, aligned=True)


def test_two_saves_at_once_leave_torchs_settings_as_they_were(tmp_path: Path) -> None:
    config = torch.utils.serialization.config.save
    before = (config.storage_alignment, torch.serialization.get_crc32_options())
    state = _state()
    errors: list[BaseException] = []

    def save(name: str) -> None:
        try:
            for i in range(4):
                save_hashed(state, tmp_path / f"{name}{i}.pt")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(n,)) for n in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (config.storage_alignment, torch.serialization.get_crc32_options()) == before
    expected = _expected(state, aligned=direct.usable(tmp_path))
    assert all((tmp_path / f"{n}{i}.pt").read_bytes() == expected for n in "xy" for i in range(4))


def test_a_list_that_holds_itself_is_walked_once() -> None:
    cycle: list[Any] = [torch.zeros(BIG)]
    cycle.append(cycle)
    assert staging._aligned(cycle)
    shared = torch.zeros(BIG // 4)
    views = {f"v{i}": shared[i:] for i in range(64)}  # one storage: one record, 1 MiB
    assert not staging._aligned(views) and staging._aligned({"v": shared, "w": torch.zeros(BIG)})


def test_torchs_warning_cannot_become_an_error() -> None:
    """Imported inside someone's catch_warnings (its filter gone when the block ends), in a process
    that makes warnings errors: the writer's read of torch's read-only buffers still raises nothing."""
    code = ("import warnings, sys, tempfile, pathlib\n"
            "with warnings.catch_warnings():\n"
            "    from training.ckpt import direct\n"
            "folder = pathlib.Path(tempfile.mkdtemp())\n"
            "with direct.DirectFile(folder / 'f') as fh:\n"
            "    fh.write(memoryview(b'read-only bytes'))\n"
            "print((folder / 'f').read_bytes().decode())\n")
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "read-only bytes"


def test_a_spare_buffer_still_viewed_somewhere_does_not_fail_a_save(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed write's traceback can keep a slice of the writer's buffer alive (found when a test's
    fault injector held one): a buffer of the wrong size that cannot be unmapped yet is dropped,
    not an error."""
    old = mmap.mmap(-1, 2 * ALIGN)
    held = memoryview(old)[:ALIGN]  # an export: close() raises BufferError while it lives
    monkeypatch.setattr(direct, "_spare", [old])
    monkeypatch.setattr(direct, "CHUNK", 4 * ALIGN)
    try:
        with direct.DirectFile(tmp_path / "f") as fh:
            fh.write(b"x" * 10)
        assert (tmp_path / "f").read_bytes() == b"x" * 10 and old not in direct._spare
        monkeypatch.setattr(direct, "_spare", [direct.private_buffer(direct.CHUNK) for _ in range(direct.KEEP)])
        direct._give(old)  # the pool is full: dropped, not an error
        assert old not in direct._spare
    finally:
        held.release()


def test_sparse_tensors_are_counted_by_what_torch_writes_for_them(tmp_path: Path) -> None:
    """A sparse tensor has no storage of its own (untyped_storage raises NotImplementedError):
    torch.save writes its indices and values, and so are they counted; the checkpoint loads."""
    from training.ckpt.files import state_bytes, storage_sizes

    sparse = torch.eye(BIG // 64).to_sparse()  # 16384 non-zeros: indices 256 KiB, values 64 KiB
    state = {"w": torch.ones(BIG // 4), "s": sparse, "again": sparse}
    sizes = storage_sizes(state)
    assert sorted(sizes.values()) == [sparse._values().nbytes, sparse._indices().nbytes, BIG]
    assert state_bytes(state) == BIG + sparse._values().nbytes + sparse._indices().nbytes
    # A compressed layout is its compressed indices, plain indices and values too, not its dense
    # size (a 1000x1000 identity: tens of KiB written, not 4 MB).
    csr = torch.eye(1000).to_sparse_csr()
    assert sorted(storage_sizes({"csr": csr}).values()) == sorted(  # whole storages, as torch.save writes
        t.untyped_storage().nbytes() for t in (csr.crow_indices(), csr.col_indices(), csr.values()))
    csc = torch.eye(1000).to_sparse_csc()
    assert sorted(storage_sizes({"csc": csc}).values()) == sorted(
        t.untyped_storage().nbytes() for t in (csc.ccol_indices(), csc.row_indices(), csc.values()))
    assert state_bytes({"csr": csr}) < csr.nelement() * csr.element_size() // 100
    save_hashed(state, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(loaded["s"].to_dense(), sparse.to_dense()) and torch.equal(loaded["w"], state["w"])
