"""The durable figure's two limits (training/trainer/bench.py): the checkpoint's bytes written raw and
fsync'd, once through the page cache and once around it (O_DIRECT, the way training/ckpt/direct.py
writes ours). Neither serialises, hashes or copies: each bounds what any writer of these bytes
can do on this disk, the way it writes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from training.ckpt import direct
from training.ckpt.direct import ALIGN, CHUNK

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def buffered(tensors: list[torch.Tensor], path: Path) -> dict[str, float]:
    """The bytes written to one file with os.write straight from the tensors' memory (no Python
    file object, no copy) and fsync'd. `copy` is the part before the fsync: the bytes copied into
    the page cache."""
    views = [t.detach().cpu().contiguous().numpy().data.cast("B") for t in tensors]
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for view in views:
            while view:
                view = view[os.write(fd, view):]
        copied = time.perf_counter() - started
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - started
    path.unlink()
    return {"durable": took, "copy": copied}


class Direct:
    """The bytes copied once, before any clock, into one page-aligned buffer (as O_DIRECT needs:
    open(2)) of the kind ours writes from (direct.private_buffer: private, with huge pages asked
    for; from the plain shared mapping this limit used before, a GB took 0.38-0.43 s from one
    buffer and 0.51-0.58 s from another here, so the limit could come out slower than ours;
    from huge pages, 0.35-0.43 s from every buffer). Each run writes that buffer with O_DIRECT
    in direct.CHUNK pieces at aligned offsets, truncates the file to the bytes' size and fsyncs.
    (Ours writes a large storage in one pwritev from its own memory, with the records before it;
    the piece size does not change this limit: 1 GiB in pieces of 16, 64, 256 and 1024 MiB took
    0.537, 0.533, 0.529 and 0.528 s, medians of six, rotated, from small pages.) `supported` is
    False where ours would not write around the page cache either (direct.usable: not a local
    block file system, or one that refuses O_DIRECT), and then there is no such limit to report
    (nor its buffer)."""

    def __init__(self, tensors: list[torch.Tensor], folder: Path):
        self.size = sum(t.numel() * t.element_size() for t in tensors)
        folder.mkdir(parents=True, exist_ok=True)
        self.supported = direct.usable(folder)
        self._buffer = direct.private_buffer(max(ALIGN, -(-self.size // ALIGN) * ALIGN) if self.supported else ALIGN)
        if not self.supported:
            return
        pos = 0
        for t in tensors:
            data = t.detach().cpu().contiguous().numpy().data.cast("B")
            self._buffer[pos:pos + len(data)] = data
            pos += len(data)

    def run(self, path: Path) -> dict[str, float]:
        took = self.write(path)
        path.unlink()
        return {"durable": took}

    def write(self, path: Path) -> float:
        """Seconds to write and fsync the bytes to `path` (left there)."""
        view = memoryview(self._buffer)
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
        try:
            for start in range(0, len(view), CHUNK):
                piece, done = view[start:start + CHUNK], 0
                while done < len(piece):
                    done += os.pwrite(fd, piece[done:], start + done)
            os.ftruncate(fd, self.size)
            os.fsync(fd)
        finally:
            os.close(fd)
            view.release()
        return time.perf_counter() - started

    def close(self) -> None:
        self._buffer.close()
