"""training/ckpt/direct.py's buffers ask for transparent huge pages (madvise MADV_HUGEPAGE): the
staged state's kept buffers, the writer's own buffer and the bench's direct limit's buffer are
the same kind of memory, which the disk reads in fewer, larger pieces. The kernel's own record of
each mapping (/proc/self/smaps, VmFlags `hg`) says whether it was asked; a kernel that refuses
the advice still gets its buffer."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest
import torch

from training.ckpt import direct
from training.ckpt.staging import Stager
from training.trainer import bench_limits

SMAPS = Path("/proc/self/smaps")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (proc(5), /proc/pid/smaps)."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _address(buffer: Any) -> int:
    return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()


def _advice_recorded() -> bool:
    """Whether this kernel takes MADV_HUGEPAGE and records it (a kernel without transparent huge
    pages refuses it; a sandbox may accept and drop it): a scratch mapping asked directly."""
    probe = mmap.mmap(-1, 2 * direct.HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    try:
        probe.madvise(mmap.MADV_HUGEPAGE)
        return "hg" in _vm_flags(_address(probe))
    except OSError:
        return False
    finally:
        probe.close()


@pytest.fixture
def recorded() -> None:
    if not SMAPS.exists() or not hasattr(mmap, "MADV_HUGEPAGE") or not _advice_recorded():
        pytest.skip("no /proc/self/smaps, or no transparent huge pages this kernel records here")


def test_buffers_of_a_huge_page_or_more_ask_for_huge_pages(recorded: None) -> None:
    big = direct.private_buffer(direct.HUGE_PAGE * 3)
    small = direct.private_buffer(direct.HUGE_PAGE // 2)
    try:
        assert "hg" in _vm_flags(_address(big))
        assert "hg" not in _vm_flags(_address(small))  # none fits in it: nothing asked
    finally:
        big.close()
        small.close()


def test_the_kept_buffers_the_writers_buffer_and_the_limit_are_the_same_memory(tmp_path: Path,
                                                                                recorded: None) -> None:
    state = {"w": torch.randn(direct.HUGE_PAGE), "b": torch.randn(3)}  # 8 MiB and 12 bytes
    staged = Stager().stage(state)
    assert "hg" in _vm_flags(staged["w"].data_ptr())
    with direct.DirectFile(tmp_path / "f") as writer:
        assert "hg" in _vm_flags(_address(writer._buffer))
    limit = bench_limits.Direct([state["w"]], tmp_path)
    try:
        if limit.supported:
            assert "hg" in _vm_flags(_address(limit._buffer))
    finally:
        limit.close()


def test_a_kernel_that_refuses_the_advice_still_gives_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    real = mmap.mmap
    asked: list[int] = []

    class NoHugePages(real):  # type: ignore[misc,valid-type]
        def madvise(self, option: int, *args: int) -> None:
            asked.append(option)
            raise OSError(22, "Invalid argument")  # a kernel built without transparent huge pages

    monkeypatch.setattr(mmap, "mmap", NoHugePages)
    buffer = direct.private_buffer(direct.HUGE_PAGE)
    try:
        assert asked == [mmap.MADV_HUGEPAGE] and len(buffer) == direct.HUGE_PAGE
        buffer[:4] = b"gts!"
        assert buffer[:4] == b"gts!"
    finally:
        buffer.close()
