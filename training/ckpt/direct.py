"""A checkpoint file written around the page cache (O_DIRECT), falling back to plain writes where the
file system refuses it.

Why: a buffered write copies every byte into the page cache first, and on a VM that hands freed
memory back to its host (free page reporting: virtio_balloon, `page_reporting_order`) that copy
pays for the host to hand the memory back again. Measured here (docs/goodput-and-bench.md): 1 GiB
copied into the page cache took 0.33-0.58 s into memory freed just before and 5.0-8.4 s into
memory freed 8 s earlier, and `perf` put 87 % of a slow copy in the kernel's copy into the page
cache. `dd` of 1 GiB with `oflag=direct conv=fsync` took 0.56-0.68 s in six runs; buffered with
`conv=fsync`, 0.98-3.09 s. A checkpoint is written once and read back rarely (resume, an upload
that streams it), so its pages are not worth caching either.

O_DIRECT needs the memory, the file offset and the length of every write aligned to the device's
logical block (open(2), "O_DIRECT": 512 bytes on most devices, 4096 covers both). torch.save hands
over storages at 64-byte offsets from unaligned memory, so the bytes pass through a page-aligned
buffer of CHUNK bytes (kept between files, so it is memory already in use: a fresh one would pay
the cost above), each full buffer written at an aligned offset. (Two buffers, one copied into
while the other is written on a helper thread, measured slower here: 0.52 s against 0.47 s a
GiB, median of six, with the raw O_DIRECT limit at 0.46 s.) `flush` writes the partial last
buffer padded with zeros and truncates the file to its real size (ftruncate(2)); more bytes after
a flush rewrite that last block in place. The caller still fsyncs: O_DIRECT does not make the
file's size or the device's cache durable (open(2), "O_DIRECT" is not O_SYNC).

Falls back to plain buffered writes, the same bytes at the same offsets, when the open (EINVAL:
a file system without O_DIRECT) or any write (EINVAL: an alignment the device refuses) is
refused; `direct` says which way the file went."""

from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os
import threading
from pathlib import Path
from typing import Any

ALIGN = 4096
CHUNK = 16 << 20  # 16 MiB: as fast as 64 MiB with dd here (0.56-0.64 s a GiB), a quarter of the memory
KEEP = 2  # buffers kept for the next files (one per file being written at once)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_spare: list[mmap.mmap] = []
_lock = threading.Lock()


def _take() -> mmap.mmap:
    with _lock:
        while _spare:
            buffer = _spare.pop()
            if len(buffer) == CHUNK:
                return buffer
            buffer.close()
    return mmap.mmap(-1, CHUNK)  # anonymous and page-aligned


def _give(buffer: mmap.mmap) -> None:
    with _lock:
        if len(_spare) < KEEP:
            _spare.append(buffer)
            return
    buffer.close()


class DirectFile(io.RawIOBase):
    """A new file at `path` (created as open(path, "wb") would, truncated), written with O_DIRECT
    through an aligned buffer. Writes are sequential; `fileno()` is the file's descriptor for the
    caller's fsync."""

    def __init__(self, path: Path | str, mode: int = 0o666):
        super().__init__()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.direct = bool(_O_DIRECT)
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(path, flags | _O_DIRECT, mode)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self._fd < 0:
            self._fd = os.open(path, flags, mode)
        self.size = 0  # bytes the caller has written
        self._done = 0  # bytes before the buffer's start: written, aligned
        self._fill = 0  # bytes in the buffer
        self._failed = False  # a write failed: the caller discards the file, close does not flush it
        self._buffer = _take()
        self._view = memoryview(self._buffer)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size, pos = len(view), 0
        while pos < size:
            n = min(CHUNK - self._fill, size - pos)
            self._view[self._fill:self._fill + n] = view[pos:pos + n]
            self._fill += n
            pos += n
            if self._fill == CHUNK:
                self._write_at(self._done, CHUNK)
                self._done += CHUNK
                self._fill = 0
        self.size += size
        return size

    def flush(self) -> None:
        """Everything written so far is in the file (not yet fsync'd), and the file is its size."""
        if self.closed or not self._fill:
            return
        padded = -(-self._fill // ALIGN) * ALIGN
        self._view[self._fill:padded] = bytes(padded - self._fill)  # the buffer is reused: no old bytes
        self._write_at(self._done, padded)
        os.ftruncate(self._fd, self.size)

    def _write_at(self, offset: int, length: int) -> None:
        pos = 0
        while pos < length:
            try:
                pos += os.pwrite(self._fd, self._view[pos:length], offset + pos)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    self._failed = True
                    raise
                self._plain()  # the device refused the alignment: the same bytes, through the page cache

    def _plain(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._failed:
                self.flush()
        finally:
            self._fill = 0  # IOBase.close flushes again
            self._view.release()
            _give(self._buffer)
            os.close(self._fd)
            super().close()
