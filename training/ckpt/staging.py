"""What lets the training loop go on while a checkpoint is written: a copy of the state in
buffers kept from one checkpoint to the next (pinned host memory for GPU tensors, so the copy is a
DMA the loop waits for only once), and a writer that hashes the bytes as torch serialises them
(no second read of the file; 8 MiB pieces on helper threads, training/ckpt/digest.py) without torch's
per-record CRC32 (the manifest's digest guards the file, and the CRC was most of the
serialiser's time: 3.8 s -> 0.5 s per GB measured here)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.utils.serialization  # the save config (not imported by `import torch`)

from training.ckpt import digest
from training.ckpt.files import storage_sizes
from training.ckpt.direct import STORAGE_ALIGNMENT, DirectFile, aligned_empty


class Stager:
    """Copies a (nested) state into reused buffers. One staged state at a time: the caller must
    not stage again while the previous copy is still being written (the manager waits)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.bytes = 0

    def stage(self, state: Any) -> Any:
        staged = self._copy(state, ())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies have landed: the loop may change the originals
        return staged

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, Mapping):
            copied = type(value)() if isinstance(value, OrderedDict) else {}
            for k, v in value.items():
                copied[k] = self._copy(v, (*path, k))
            if hasattr(value, "_metadata"):  # a module state_dict's versions (load_state_dict reads them)
                setattr(copied, "_metadata", copy.deepcopy(getattr(value, "_metadata")))
            return copied
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if source.is_cuda and torch.cuda.is_available():  # pinned: page-aligned (cudaHostAlloc)
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
            else:  # on a page, so the writer skips its copy (training/ckpt/direct.py)
                buffer = aligned_empty(source.shape, source.dtype)
            self._buffers[path] = buffer
            self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it as the manifest's `blake3_pieces`
    (training/ckpt/digest.py): the bytes are cut at every 8 MiB of the file, and each piece is hashed
    on a pool of helper threads while the caller's thread writes. The hash and the write both
    release the GIL, so on N cores a checkpoint costs about the write, not one sha256 stream
    (1 GB/s here, twice the disk's write + fsync). A large write (torch hands over a tensor's
    whole storage in one call) is hashed in place; the pieces of it are hashed before `write`
    returns (the caller's buffer may be freed afterwards). Small writes and the ends of large
    ones gather in a buffer of their own until it holds a whole piece."""

    def __init__(self, fh: BinaryIO | io.RawIOBase, workers: int = digest.WORKERS):
        super().__init__()
        self.fh = fh
        self.size = 0
        self._partial = bytearray()
        self._digests: list[Future[bytes]] = []
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-hash")

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size, pos = len(view), 0
        if self._partial:
            pos = min(digest.PIECE - len(self._partial), size)
            self._partial += view[:pos]
            if len(self._partial) == digest.PIECE:
                self._flush_partial()
        inplace = []
        while size - pos >= digest.PIECE:  # whole pieces of the caller's buffer: no copy
            inplace.append(self._pool.submit(digest.piece_digest, view[pos:pos + digest.PIECE]))
            pos += digest.PIECE
        self._digests.extend(inplace)
        self._partial += view[pos:]
        self.fh.write(view)
        for future in inplace:
            future.result()
        self.size += size
        return size

    def _flush_partial(self) -> None:
        full, self._partial = self._partial, bytearray()
        self._digests.append(self._pool.submit(digest.piece_digest, full))

    def hexdigest(self) -> str:
        """The file's `blake3_pieces`, once everything is written."""
        if self._partial:
            self._flush_partial()
        return digest.combine([d.result() for d in self._digests])

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()


def save_hashed(obj: Any, path: Path) -> tuple[int, str]:
    """torch.save `obj` to `path` (through `path.part`, fsync'd, renamed) without torch's CRC32
    records, hashing while writing, storages placed for the writer's zero-copy writes where that
    pays (`_aligned`). Returns (size, blake3_pieces).

    The format stays torch.save's zip archive (not DCP's or safetensors'): it is what the
    resume path loads (torch.load, weights_only), what every checkpoint written so far is,
    and it holds the non-tensor state (step, schedule, config) beside the tensors; its cost was
    the single hash stream, not the serialiser."""
    part = path.with_suffix(path.suffix + ".part")
    with DirectFile(part) as fh, HashingWriter(fh) as writer:
        with _serialiser_options(aligned=fh.direct and _aligned(obj)):
            torch.save(obj, writer)  # type: ignore[arg-type]  # a binary file-like object
        fh.flush()
        os.fsync(fh.fileno())  # the disk's writeback overlaps the hashing of the last pieces
        hexdigest = writer.hexdigest()
    os.replace(part, path)
    return writer.size, hexdigest


TORCH_RECORDS = 6  # data.pkl, .format_version, .storage_alignment, byteorder, version, .data/serialization_id


def _aligned(obj: Any) -> bool:
    """Whether to place the storages at STORAGE_ALIGNMENT: when the padding that costs (up to a
    block for each storage torch writes, and for each of its own records) is at most 1/64 of the
    storages' bytes (files.storage_sizes)."""
    sizes = storage_sizes(obj)
    records = len(sizes) + TORCH_RECORDS
    return bool(sizes) and records * STORAGE_ALIGNMENT * 64 <= sum(sizes.values())


# torch's serialiser settings are the process's, not the call's: saves of our own take turns.
_SETTINGS = threading.Lock()


@contextlib.contextmanager
def _serialiser_options(aligned: bool = True) -> Iterator[None]:
    """torch.save without its CRC32 records and, when `aligned`, with storages at
    STORAGE_ALIGNMENT in the file (the zip's local headers padded: torch.load reads any
    alignment), both restored afterwards. Both are process-wide settings of torch
    (torch.serialization.set_crc32_options, torch.utils.serialization.config.save.storage_alignment,
    64 by default), so a torch.save another thread makes meanwhile (the peer copy's) may get them
    too: its file has no CRC32 records or more padding, and loads as any other. The CRC32 setting
    was shared this way before the alignment was; the window is the torch.save call alone."""
    config = torch.utils.serialization.config.save
    with _SETTINGS:
        crc32, alignment = torch.serialization.get_crc32_options(), config.storage_alignment
        torch.serialization.set_crc32_options(False)
        if aligned:
            config.storage_alignment = STORAGE_ALIGNMENT
        try:
            yield
        finally:
            config.storage_alignment = alignment
            torch.serialization.set_crc32_options(crc32)
