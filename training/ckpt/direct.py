"""A checkpoint file written around the page cache (O_DIRECT), falling back to plain writes where the
file system refuses it.

Why: a buffered write copies every byte into the page cache first, and on a VM that hands freed
memory back to its host (free page reporting: virtio_balloon, `page_reporting_order`) that copy
pays for the host to hand the memory back again. Measured here (docs/goodput-and-bench.md): 1 GiB
copied into the page cache took 0.33-0.58 s into memory freed just before and 5.0-8.4 s into
memory freed 8 s earlier, and `perf` put 87 % of a slow copy in the kernel's copy into the page
cache. `dd` of 1 GiB with `oflag=direct conv=fsync` took 0.56-0.68 s in six runs; buffered with
`conv=fsync`, 0.98-3.09 s. The upload (training/ckpt/uploader.py) reads the file back once, now
from the disk, off the durable clock; a resume on the same node reads it from the disk too.

O_DIRECT needs the memory, the file offset and the length of every write aligned to the device's
logical block (open(2), "O_DIRECT": 512 bytes on most devices, 4096 covers both). The staged
tensors of ZERO_COPY_MIN bytes or more start on a page (`aligned_empty`, the Stager's buffers)
and save_hashed has torch.save place every storage at a STORAGE_ALIGNMENT offset of the file, so
the whole blocks of such a storage are written straight from its memory (`_zero_copy`: 1 GB in
0.48/0.58 s min/median against 0.52/0.75 s copied, six each, alternating). Everything else (the
zip's headers, the tails of storages, memory off a page) passes through a page-aligned buffer of
CHUNK bytes (kept between files, so it is memory already in use: a fresh one would pay the cost
above), each full buffer written at an aligned offset. (Two buffers, one copied into while the
other is written on a helper thread, measured slower here: 0.52 s against 0.47 s a GiB, median
of six, with the raw O_DIRECT limit at 0.46 s.) If the device cannot read the caller's memory
(EFAULT: memory a driver mapped, such as some pinned host memory), that file's storages go
through the buffer as well. `flush` writes the partial last
buffer padded with zeros and truncates the file to its real size (ftruncate(2)); more bytes after
a flush rewrite that last block in place. The caller still fsyncs: O_DIRECT does not make the
file's size or the device's cache durable (open(2), "O_DIRECT" is not O_SYNC).

The copy into the buffer is torch's `copy_`, which releases the GIL (a memoryview slice assignment
holds it: measured here, a thread copying 1 GiB that way slowed the main thread's Python work
1.8-fold, with `copy_` 1.1-fold), so the training loop keeps running while a checkpoint is copied.

Only on a local block file system (DIRECT_FILESYSTEMS, read from /proc/self/mountinfo by the
folder's device): on NFS or Lustre every O_DIRECT write waits for the server, FUSE and overlay
may refuse it or differ, and tmpfs is the page cache. Elsewhere, and when the open (EINVAL: a file
system without O_DIRECT) or any write (EINVAL: an alignment the device refuses) is refused, the
same bytes go to the same offsets through the page cache; `direct` says which way the file went,
and the first fallback of each kind is logged once."""

from __future__ import annotations

import errno
import fcntl
import functools
import io
import logging
import mmap
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

ALIGN = 4096
CHUNK = 16 << 20  # 16 MiB: as fast as 64 MiB with dd here (0.56-0.64 s a GiB), a quarter of the memory
KEEP = 2  # buffers kept for the next files (one per file being written at once)
ZERO_COPY_MIN = 1 << 20  # a write this large, aligned in memory and in the file, skips the buffer
STORAGE_ALIGNMENT = ALIGN  # torch.save's storage offsets in the file, for the zero-copy writes
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 with 4 KiB pages (private_buffer)
DIRECT_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_spare: list[mmap.mmap] = []
_lock = threading.Lock()
log = logging.getLogger("gts.checkpoint")


def _take() -> mmap.mmap:
    with _lock:
        while _spare:
            buffer = _spare.pop()
            if len(buffer) == CHUNK:
                return buffer
            _discard(buffer)
    return private_buffer(CHUNK)


def _give(buffer: mmap.mmap) -> None:
    with _lock:
        if len(_spare) < KEEP and all(b is not buffer for b in _spare):
            _spare.append(buffer)
            return
    _discard(buffer)


def _discard(buffer: mmap.mmap) -> None:
    """Unmap a buffer now, or, while a view of it is still alive somewhere (a failed write's
    traceback can hold a slice of it), when the last view goes: never an error in a save."""
    try:
        buffer.close()
    except BufferError:
        pass


def _pwrite_parts(fd: int, views: list[memoryview], pos: int, offset: int) -> int:
    """One write of `views`, back to back in the file from `offset`, from their byte `pos` on
    (at offset + pos): pwrite where one part is left, pwritev for more. Returns the bytes written."""
    at, rest = offset + pos, []
    for view in views:
        if pos < len(view):
            rest.append(view[pos:])
        pos = max(0, pos - len(view))
    try:
        return os.pwrite(fd, rest[0], at) if len(rest) == 1 else os.pwritev(fd, rest, at)
    finally:  # a failed write's traceback keeps this frame: its slices must not keep the buffer mapped
        for view in rest:
            view.release()


def filesystem(folder: Path | str) -> str:
    """The type of the file system `folder` is on ("" when /proc/self/mountinfo does not say):
    the mount whose device is the folder's (proc(5), /proc/pid/mountinfo: field 3 is major:minor,
    the type follows the " - " separator)."""
    dev = os.stat(folder).st_dev
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 2 and parts[2] == wanted and rest:
            return rest.split()[0]
    return ""


def usable(folder: Path | str) -> bool:
    """Whether a DirectFile in `folder` goes around the page cache: a local block file system that
    takes an O_DIRECT open."""
    if not _O_DIRECT or filesystem(folder) not in DIRECT_FILESYSTEMS:
        return False
    probe = Path(folder) / f".direct-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


@functools.cache
def _note(why: str) -> None:
    log.info("checkpoint files are written through the page cache: %s", why)


# torch warns, once a process (TORCH_WARN_ONCE), that a tensor over a read-only buffer could be
# written through: `_bytes` only reads them. The filter is set once here (warnings.catch_warnings
# around each call is not thread-safe, and the writer runs beside the training loop), and the one
# warning is spent here, under it: a filter lost later (this module imported inside someone's
# catch_warnings) cannot let it reach a program that turns warnings into errors.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
torch.frombuffer(bytes(1), dtype=torch.uint8)


class _Unreadable(Exception):
    """An O_DIRECT write could not read the caller's memory (EFAULT)."""


@functools.cache
def _note_zero_copy() -> None:
    log.info("checkpoint storages are copied through the writer's buffer: the device could not read "
             "their memory directly (EFAULT)")


def _bytes(data: Any) -> torch.Tensor:
    """A uint8 tensor over `data`'s memory, no copy."""
    return torch.frombuffer(data, dtype=torch.uint8)


def aligned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a page (an anonymous mmap, kept alive by
    the tensor), so `DirectFile` writes it to the file without a copy when torch.save places its
    storage at an aligned offset (STORAGE_ALIGNMENT). The storage is exactly the tensor's bytes:
    torch.save writes whole storages. The mapping is private, as torch's own large allocations
    are (MAP_SHARED memory is shmem: no transparent huge pages where only anonymous memory gets
    them), with huge pages asked for (private_buffer). Tensors under ZERO_COPY_MIN bytes, that
    torch.frombuffer refuses, or that the kernel will not map (ENOMEM: vm.max_map_count reached,
    a strict overcommit) come from torch.empty: the writer copies them, as it did every tensor
    before."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes >= ZERO_COPY_MIN:
        try:
            return torch.frombuffer(private_buffer(nbytes), dtype=dtype, count=numel).view(shape)
        except (RuntimeError, OSError):  # torch refuses the buffer or dtype; the kernel refuses the mapping
            pass
    return torch.empty(shape, dtype=dtype)


def private_buffer(size: int) -> mmap.mmap:
    """Anonymous, private, page-aligned memory (mmap(2); Python adds MAP_ANONYMOUS for fd -1),
    asking for transparent huge pages where it spans one (madvise(2) MADV_HUGEPAGE: where
    /sys/kernel/mm/transparent_hugepage/enabled is `madvise`, as here, only memory that asks gets
    them; with `always`, any large mapping may). Memory the disk reads by O_DIRECT in 2 MiB
    pieces is fewer, larger segments for the device's requests, and a copy into it takes fewer
    page walks. Measured here (docs/goodput-and-bench.md, "Huge pages"), two runs each, the
    allocation order swapped (from small pages a GB took 0.38-0.43 s from one buffer and
    0.51-0.58 s from another; from huge pages 0.35-0.43 s from every buffer): durable medians
    53.5 and 54.3 ms against 78.6 and 68.3 ms at 100 MB (twelve rounds), 422 and 433 ms against
    557 and 471 ms at 1 GB (six rounds); the loop's copy 13-15 ms against 18-20 ms and 103-108 ms
    against 117-124 ms. A kernel without transparent huge pages (EINVAL) or with them set to
    `never` gives small pages, as before."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no transparent huge pages in this kernel: small pages
            pass
    return buffer


class DirectFile(io.RawIOBase):
    """A new file at `path` (created as open(path, "wb") would, truncated), written with O_DIRECT
    through an aligned buffer. Writes are sequential; `fileno()` is the file's descriptor for the
    caller's fsync."""

    def __init__(self, path: Path | str, mode: int = 0o666):
        super().__init__()
        self._fd = -1
        self._buffer: mmap.mmap | None = _take()  # before the open: nothing to undo if it fails
        self._view = _bytes(self._buffer)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        kind = filesystem(Path(path).parent)
        self.direct = bool(_O_DIRECT) and kind in DIRECT_FILESYSTEMS
        if not self.direct:
            _note(f"{kind or 'an unknown file system'} is not a local block file system")
        try:
            if self.direct:
                try:
                    self._fd = os.open(path, flags | _O_DIRECT, mode)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self.direct = False
                    _note(f"{kind} refused O_DIRECT at the open")
            if self._fd < 0:
                self._fd = os.open(path, flags, mode)
        except BaseException:
            self._release()
            raise
        self.size = 0  # bytes the caller has written
        self._flushed = 0  # self.size at the last flush: a flush with nothing new writes nothing
        self._done = 0  # bytes before the buffer's start: written, aligned
        self._fill = 0  # bytes in the buffer
        self._failed = False  # a write failed: the caller discards the file, nothing more is written
        self._zero = True  # storages may go straight from the caller's memory (until EFAULT says not)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if not len(view):
            return 0
        source = _bytes(view)
        size, pos = source.numel(), self._zero_copy(view, source)
        while pos < size:
            n = min(CHUNK - self._fill, size - pos)
            self._view[self._fill:self._fill + n].copy_(source[pos:pos + n])  # the GIL released
            self._fill += n
            pos += n
            if self._fill == CHUNK:
                self._write_at(self._done, CHUNK)
                self._done += CHUNK
                self._fill = 0
        self.size += size
        return size

    def flush(self) -> None:
        """Everything written so far is in the file (not yet fsync'd), and the file is its size.
        Nothing is written when nothing was since the last flush, or after a failed write."""
        if self.closed or self._fd < 0 or self._failed or not self._fill or self.size == self._flushed:
            return
        padded = -(-self._fill // ALIGN) * ALIGN
        self._view[self._fill:padded] = 0  # the buffer is reused: no old bytes
        self._write_at(self._done, padded)
        os.ftruncate(self._fd, self.size)
        self._flushed = self.size

    def _zero_copy(self, view: memoryview, source: torch.Tensor) -> int:
        """Writes the aligned whole blocks at the start of `view` straight from the caller's
        memory, when the memory and the file position are both aligned (a storage torch.save
        placed at STORAGE_ALIGNMENT, from `aligned_empty`'s memory) and there are ZERO_COPY_MIN
        bytes or more of them; the buffer's bytes before it go in the same write, just before them
        (a whole number of blocks, as the position is aligned). Returns how many bytes of `view` it
        wrote."""
        length = len(view) // ALIGN * ALIGN
        if (not self.direct or not self._zero or length < ZERO_COPY_MIN or source.data_ptr() % ALIGN
                or (self._done + self._fill) % ALIGN):
            return 0
        try:  # the buffer's bytes in the same request: one synchronous write to the device, not two
            self._write_at(self._done, length, view, head=self._fill)
        except _Unreadable:  # the buffer still holds its bytes, and these are appended to them
            self._zero = False  # the caller copies these bytes (and the file's next storages) through the buffer
            _note_zero_copy()
            return 0
        self._done += self._fill + length
        self._fill = 0
        return length

    def _write_at(self, offset: int, length: int, source: memoryview | None = None, head: int = 0) -> None:
        """Writes `length` bytes of `source` (the buffer when None) at `offset`; with `head`, the
        buffer's first `head` bytes just before them, in the same call (pwritev). A small O_DIRECT
        write is a request the device completes before the call returns: a storage's write
        carrying the records before it saves one (0.3-3 ms each here, issue 44)."""
        assert self._buffer is not None
        views = [memoryview(self._buffer)[:head]] if head else []
        views.append(memoryview(self._buffer if source is None else source)[:length])
        total, pos = head + length, 0
        try:
            while pos < total:
                try:
                    pos += _pwrite_parts(self._fd, views, pos, offset)
                except OSError as exc:
                    if source is not None and exc.errno == errno.EFAULT and self.direct:
                        raise _Unreadable() from exc  # nothing lost: the same offsets are written again
                    if exc.errno != errno.EINVAL or not self.direct:
                        self._failed = True
                        raise
                    self._plain()  # the device refused the alignment: the same bytes, through the page cache
        finally:
            for view in views:
                view.release()

    def _plain(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False
        _note("the device refused an aligned O_DIRECT write")

    def _release(self) -> None:
        """Give the buffer back and close the descriptor, each once, whatever fails."""
        buffer, self._buffer = self._buffer, None
        fd, self._fd = self._fd, -1
        try:
            if buffer is not None:
                del self._view
                _give(buffer)
        finally:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._fd >= 0:
                self.flush()
        finally:
            try:
                self._release()
            finally:
                super().close()
