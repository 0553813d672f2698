"""What lets the training loop go on while a checkpoint is written: a copy of the state in
buffers kept from one checkpoint to the next (pinned host memory for GPU tensors, so the copy is a
DMA the loop waits for only once), and a writer that hashes the bytes as torch serialises them
(no second read of the file; 8 MiB pieces on helper threads, training/ckpt/digest.py) without torch's
per-record CRC32 (the manifest's digest guards the file, and the CRC was most of the
serialiser's time: 3.8 s -> 0.5 s per GB measured here)."""

from __future__ import annotations

import bisect
import contextlib
import copy
import io
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.utils.serialization  # the save config (not imported by `import torch`)

from training.ckpt import digest
from training.ckpt.files import cpu_spans, storage_sizes
from training.ckpt.direct import STORAGE_ALIGNMENT, DirectFile, aligned_empty


class Stager:
    """Copies a (nested) state into reused buffers. One staged state at a time: the caller must
    not stage again while the previous copy is still being written (the manager waits)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.bytes = 0

    def stage(self, state: Any) -> Any:
        staged, copies = self.plan(state)
        self.fill(copies)
        return staged

    def plan(self, state: Any) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The staged state (this stager's buffers in the state's place, made where missing, other
        values copied) and its copies still to make, (buffer, source) in the state's order."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        return self._copy(state, (), copies), copies

    @staticmethod
    def fill(copies: list[tuple[torch.Tensor, torch.Tensor]], staged: Staged | None = None) -> None:
        """Make `copies` (plan's), in order, telling `staged` (a save already writing them) as each
        is in: a copy from host memory at once, one from a GPU once every copy has landed. Returns
        when the loop may change the originals; a copy that fails fails `staged` too."""
        try:
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=source.is_cuda)
                if staged is not None and not source.is_cuda:
                    staged.arrived(buffer)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking copies have landed: the loop may change the originals
        except BaseException as exc:
            if staged is not None:
                staged.failed(exc)
            raise
        if staged is not None:
            staged.complete()

    def _copy(self, value: Any, path: tuple[Any, ...], copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, copies)
        if isinstance(value, Mapping):
            copied = type(value)() if isinstance(value, OrderedDict) else {}
            for k, v in value.items():
                copied[k] = self._copy(v, (*path, k), copies)
            if hasattr(value, "_metadata"):  # a module state_dict's versions (load_state_dict reads them)
                setattr(copied, "_metadata", copy.deepcopy(getattr(value, "_metadata")))
            return copied
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, (*path, i), copies) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...],
                copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if source.is_cuda and torch.cuda.is_available():  # pinned: page-aligned (cudaHostAlloc)
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
            else:  # on a page, so the writer skips its copy (training/ckpt/direct.py)
                buffer = aligned_empty(source.shape, source.dtype)
            self._buffers[path] = buffer
            self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        copies.append((buffer, source))
        return buffer


class CopyFailed(Exception):
    """The loop's copy of the state failed while a save was writing it: the step is not committed."""


class Staged:
    """The host memory of a state's storages (files.cpu_spans), by address: what a HashingWriter
    may hash while and after it is written, as it stays as it is until save_hashed returns. For a
    state still being copied (Stager.fill: the writer starts while the loop copies, issue 44), each
    storage's copy is waited for before it is written, and nothing is hashed until every copy is
    in: the hash threads would take the cores the loop's copy runs on. A copy from a GPU is in
    once every copy has landed (one synchronize): there the writer waits for all of them."""

    def __init__(self, state: Any, copying: bool = False):
        spans = sorted(cpu_spans(state))
        self.copying = copying
        self._starts = [start for start, _ in spans]
        self._ends = [start + size for start, size in spans]
        self._index = {start: k for k, start in enumerate(self._starts)}
        self._in = [threading.Event() for _ in spans]
        self.written = [0] * len(spans)  # bytes written from each span's memory (the writer's thread alone)
        self.all_in = threading.Event()
        self._error: BaseException | None = None
        if not copying:
            self.complete()

    def holding(self, view: memoryview) -> int | None:
        """The span that holds all of `view`'s bytes, or None."""
        if not len(view):
            return None
        address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
        k = bisect.bisect_right(self._starts, address) - 1
        return k if k >= 0 and address + len(view) <= self._ends[k] else None

    def wait(self, span: int | None = None) -> None:
        """Until `span`'s copy is in (every copy, for None); raises CopyFailed if the copy failed."""
        (self.all_in if span is None else self._in[span]).wait()
        self.check()

    def check(self) -> None:
        """Raises CopyFailed if the copy failed."""
        if self._error is not None:
            raise CopyFailed(f"the copy of the state failed: {self._error!r}")

    def verify(self) -> None:
        """Once the state is written: every copy in, and, for a state that was being copied, all of
        each storage's bytes written from its own memory, once; raises CopyFailed if not (bytes of
        a storage that came from elsewhere were not waited for: torch handing a storage over in
        another way than it does now)."""
        self.wait()
        sizes = [end - start for start, end in zip(self._starts, self._ends)]
        bad = [k for k, size in enumerate(sizes) if self.written[k] != size]
        if self.copying and bad:
            raise CopyFailed(f"{len(bad)} of the state's {len(sizes)} storages were not written from their "
                             "own memory once: the file cannot be vouched for while the copy ran")

    def arrived(self, buffer: torch.Tensor) -> None:
        """`buffer`'s copy is in: its storage may be written."""
        k = self._index.get(buffer.untyped_storage().data_ptr())
        if k is not None and buffer.untyped_storage().nbytes() == self._ends[k] - self._starts[k]:
            self._in[k].set()

    def complete(self) -> None:
        for event in self._in:
            event.set()
        self.all_in.set()

    def failed(self, error: BaseException) -> None:
        self._error = error
        self.complete()


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it as the manifest's `blake3_pieces`
    (training/ckpt/digest.py): the bytes are cut at every 8 MiB of the file, and each piece is hashed
    on a pool of helper threads as soon as it is whole, while the caller's thread writes on. The
    hash and the write both release the GIL, so on N cores a checkpoint costs about the write,
    not one sha256 stream (1 GB/s here, twice the disk's write + fsync). The bytes of `staged`'s
    storages are hashed where they are, never copied (they stay until save_hashed returns); any
    other write (torch's records, a few bytes each) is copied as it comes, or, when large and
    nothing is being copied, its whole pieces are hashed before `write` returns. Copying every
    piece that straddles writes instead cost up to two pieces per large storage (issue 44). With a
    state still being copied (Staged), each storage is written once its copy is in, and hashing
    starts once every copy is."""

    def __init__(self, fh: BinaryIO | io.RawIOBase, staged: Staged | None = None, workers: int = digest.WORKERS):
        super().__init__()
        self.fh = fh
        self.staged = staged or Staged(None)
        self.size = 0
        self._parts: deque[tuple[int, Any]] = deque()  # (offset in the file, bytes) not all hashed yet, in order
        self._digests: list[Future[bytes]] = []
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-hash")

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if not len(view):
            return 0
        span = self.staged.holding(view)
        if span is not None:
            self.staged.wait(span)  # its copy is in (at once, for a state not being copied)
            self.staged.written[span] += len(view)
        offset = self.size
        inplace = span is None and len(view) >= digest.PIECE and self.staged.all_in.is_set()
        self._parts.append((offset, view if span is not None or inplace else bytes(view)))
        self.size += len(view)
        # The pieces these bytes complete are hashed while they are written, not after: what is
        # hashed stays as it is until the write has returned (a storage until save_hashed
        # returns), and the file gets exactly these bytes or the save fails. Hashing a large
        # storage's pieces only after its one write left them all to the end (23 ms a GB here).
        hashing = self._hash(whole=True) if self.staged.all_in.is_set() else []
        try:
            self.fh.write(view)
        finally:
            if inplace:  # memory that may change once this returns: its pieces hashed now, the rest copied
                first = len(self._digests) - len(hashing)  # the piece index of hashing[0]
                wait(hashing[max(0, offset // digest.PIECE - first):])  # this write's pieces, not the backlog
                if self._parts and self._parts[-1][0] == offset:
                    cut = max(offset, len(self._digests) * digest.PIECE)
                    self._parts[-1] = (cut, bytes(view[cut - offset:]))
        return len(view)

    def _hash(self, whole: bool) -> list[Future[bytes]]:
        """Hand each piece whose bytes are all written (with `whole` False, the last one too) to
        the pool, its parts in order; returns the futures handed."""
        handed: list[Future[bytes]] = []
        while self._parts:
            start = len(self._digests) * digest.PIECE
            end = start + digest.PIECE
            if whole and self.size < end:
                break
            parts = []
            for offset, data in self._parts:  # in order, contiguous: the piece's parts come first
                if offset >= end:
                    break
                lo, hi = max(start, offset), min(end, offset + len(data))
                if lo < hi:
                    parts.append(memoryview(data)[lo - offset:hi - offset])
            while self._parts and self._parts[0][0] + len(self._parts[0][1]) <= end:
                self._parts.popleft()
            if not parts:  # nothing written past the last whole piece
                break
            handed.append(self._pool.submit(_piece_digest, parts))
            self._digests.append(handed[-1])
        return handed

    def hexdigest(self) -> str:
        """The file's `blake3_pieces`, once everything is written."""
        self.staged.wait()
        self._hash(whole=False)
        return digest.combine([d.result() for d in self._digests])

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()


def _piece_digest(parts: list[memoryview]) -> bytes:
    if len(parts) == 1:
        return digest.piece_digest(parts[0])
    piece = digest.hasher()
    for part in parts:
        piece.update(part)
    return bytes(piece.digest())


def save_hashed(obj: Any, path: Path, staged: Staged | None = None) -> tuple[int, str]:
    """torch.save `obj` to `path` (through `path.part`, fsync'd, renamed) without torch's CRC32
    records, hashing while writing, storages placed for the writer's zero-copy writes where that
    pays (`_aligned`). Returns (size, blake3_pieces).

    The format stays torch.save's zip archive (not DCP's or safetensors'): it is what the
    resume path loads (torch.load, weights_only), what every checkpoint written so far is,
    and it holds the non-tensor state (step, schedule, config) beside the tensors; its cost was
    the single hash stream, not the serialiser.

    `staged`: `obj`'s copy being made meanwhile (Stager.fill); each storage is written once its
    copy is in. Without it, `obj`'s tensors must not change until this returns (as for torch.save)."""
    part = path.with_suffix(path.suffix + ".part")
    copying = staged or Staged(obj)
    try:
        with DirectFile(part) as fh, HashingWriter(fh, copying) as writer:
            with _serialiser_options(aligned=fh.direct and _aligned(obj)):
                try:
                    torch.save(obj, writer)  # type: ignore[arg-type]  # a binary file-like object
                except Exception:
                    copying.check()  # torch reports a write that raised as a size mismatch: say why
                    raise
            copying.verify()  # every copy in, and each of its storages written from its own memory
            fh.flush()
            os.fsync(fh.fileno())  # the disk's writeback overlaps the hashing of the last pieces
            hexdigest = writer.hexdigest()
    except BaseException:
        part.unlink(missing_ok=True)  # no half-written file is left
        raise
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
