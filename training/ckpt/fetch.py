"""A checkpoint file fetched from the bucket in one pass: one GET, each piece hashed and
written as it arrives, the digest (training/ckpt/digest.py: the hash of the pieces, or the whole file's
sha256 for a format-1 manifest) compared with the manifest's before the file is renamed into
place (issue 34: resume at read speed).

Why not `fs.get`: s3fs splits a large object into 50 MB ranges fetched ten at a time, and the
file must then be read back to hash it. A server that cuts a range out of the whole object
(moto reads the object for every range request) pays the object's size per range: 1 GB in 20
ranges took 18 s here, against 1.4 s for one GET. One streamed GET also needs no second pass:
the hash is taken from the bytes received (in C, on pieces of a few MB, on a helper thread
while the next piece arrives), and a hostile store that sends more than the manifest's size is
cut off at that size. A multi-stream download (several ranges at once) is faster against a
real store only when one connection cannot fill the node's link; it would also need the
pieces hashed in order, which this keeps simple by having one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from training.ckpt.digest import StreamHasher, expected
from training.ckpt.storage import permanent_cause

PIECE = 8 << 20  # bytes handed to the hashing writer at once
MAX_CHUNKS = 1024  # received chunks joined into one: a piece of tiny chunks is a few thousand objects, not millions
ATTEMPTS = 4  # a dropped connection or a 5xx mid-file: the whole file again, a few times


class TooLong(Exception):
    """The store sent more bytes than the manifest lists."""


class _Sink:
    """Hashes (as the manifest entry's kind, training/ckpt/digest.py) and writes pieces on a helper
    thread, in order, one piece in flight at a time while the caller receives the next; counts
    the bytes and refuses more than `limit`."""

    def __init__(self, fh: BinaryIO, limit: int, kind: str):
        self.fh, self.limit = fh, limit
        self.digest = StreamHasher(kind)
        self.size = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-fetch")
        self._pending: Future[None] | None = None

    def _take(self, chunks: list[bytes]) -> None:
        for chunk in chunks:  # hashlib and the write both release the GIL on large buffers
            self.digest.update(chunk)
            self.fh.write(chunk)

    def put(self, chunks: list[bytes]) -> Future[None]:
        """Queue `chunks` once the previous piece is done; returns the previous piece's future
        (an async caller awaits it instead of blocking its event loop)."""
        self.size += sum(len(c) for c in chunks)
        if self.size > self.limit:
            raise TooLong(f"more than the {self.limit} bytes the manifest lists")
        previous = self._pending
        if previous is not None:
            previous.result()
        self._pending = self._pool.submit(self._take, chunks)
        return self._pending

    def close(self) -> None:
        try:
            if self._pending is not None:
                self._pending.result()
        finally:
            self._pool.shutdown(wait=True)


def _next_bytes(body: Any) -> Callable[[], Awaitable[bytes]]:
    """The response body's next bytes, b"" at its end. With aiobotocore's aiohttp transport: each
    chunk as it was received, one at a time (aiohttp's `StreamReader.readchunk`; a chunk of a
    chunked body as aiohttp hands it). `body.read(n)` joins every chunk waiting in aiohttp's
    buffer into a new bytes object, a copy of the whole file into fresh memory: 0.97-1.06 s of
    the process's CPU for a 1 GB GET from the bench's store against 0.82-0.84 s chunk by chunk
    (docs/goodput-and-bench.md). The size is still checked against the manifest (the sink), a
    body cut short is aiohttp's ClientPayloadError, and a read that times out its
    ServerTimeoutError: both retried as before. Any other body (aiobotocore's httpx transport)
    is read with `body.read(PIECE)`."""
    try:
        from aiobotocore.response import AioStreamingBody
    except ImportError:  # no aiobotocore: the body is not s3fs's
        return lambda: body.read(PIECE)
    content = body.raw_stream.content if isinstance(body, AioStreamingBody) else None
    if content is None or not hasattr(content, "readchunk"):
        return lambda: body.read(PIECE)

    async def received() -> bytes:
        while True:
            data, http_chunk_end = await content.readchunk()
            # (b"", True) ends an HTTP chunk, not the body; aiohttp's shared empty body answers
            # (b"", True) from its second call on, so its end is read from at_eof.
            if data or not http_chunk_end or content.at_eof():
                return data  # type: ignore[no-any-return]
    return received


async def _stream_s3(fs: Any, key: str, sink: _Sink) -> None:
    bucket, _, name = key.partition("/")
    response = await fs._call_s3("get_object", Bucket=bucket, Key=name)
    body = response["Body"]
    next_bytes = _next_bytes(body)
    try:
        chunks: list[bytes] = []
        held = joined = 0
        while True:
            chunk = await next_bytes()
            if chunk:
                chunks.append(chunk)
                held += len(chunk)
                if len(chunks) - joined >= MAX_CHUNKS:  # tiny chunks (a store's choice): the ones since
                    chunks[joined:] = [b"".join(chunks[joined:])]  # the last join become one, each byte copied once
                    joined = len(chunks)
            if held >= PIECE or (not chunk and chunks):
                if sink._pending is not None:
                    await asyncio.wrap_future(sink._pending)  # the loop keeps serving other transfers
                sink.put(chunks)
                chunks, held, joined = [], 0, 0
            if not chunk:
                return
    finally:
        body.close()


def _stream_other(fs: Any, key: str, sink: _Sink) -> None:
    with fs.open(key, "rb") as src:
        while piece := src.read(PIECE):
            sink.put([piece])


def fetch_verified(fs: Any, key: str, dest: Path | BinaryIO, meta: dict[str, Any],
                   on_fault: Callable[[str], Exception]) -> None:
    """Copy `key` from `fs` (an fsspec filesystem) to `dest`, hashing while writing: a path (a
    temporary name the caller renames into place after this returns) or an open file read and
    written from its start (a memory file: training/ckpt/loader.py's lone rank). Raises
    `on_fault(reason)`, and removes the path or empties the file, when the bytes are not the
    manifest entry `meta`'s size or digest."""
    from fsspec.asyn import sync

    size = meta["size"]
    kind, want = expected(meta)

    def discard() -> None:
        if isinstance(dest, Path):
            dest.unlink(missing_ok=True)
        else:
            dest.truncate(0)

    try:
        with dest.open("wb") if isinstance(dest, Path) else contextlib.nullcontext(dest) as fh:
            fh.seek(0)
            fh.truncate(0)  # an open file: what an earlier attempt wrote goes
            sink = _Sink(fh, size, kind)
            try:
                if hasattr(fs, "_call_s3"):  # s3fs: one GET, streamed
                    sync(fs.loop, _stream_s3, fs, key, sink)
                else:
                    _stream_other(fs, key, sink)
            finally:
                sink.close()
            fh.flush()
    except TooLong as exc:
        discard()
        raise on_fault(str(exc)) from None
    except BaseException:
        discard()
        raise
    if sink.size != size:
        discard()
        raise on_fault(f"{sink.size} bytes arrived, the manifest says {size}")
    if sink.digest.hexdigest() != want:
        discard()
        raise on_fault("does not match its digest either")


def fetch_retrying(fs: Any, key: str, dest: Path | BinaryIO, meta: dict[str, Any], on_fault: Callable[[str], Exception],
                   attempts: int = ATTEMPTS, wait_max_s: float = 8.0) -> None:
    """fetch_verified, again from the start after a transient fault (a connection dropped
    mid-stream, a timeout, a 5xx: what s3fs's ranged reads retried), with backoff. Not again
    after a fault of the bytes themselves (size, digest: the bucket's copy is bad, on_fault's
    exception) or an answer no retry changes (storage.permanent_cause): those are raised at once."""
    faults: list[Exception] = []

    def fault(why: str) -> Exception:
        faults.append(on_fault(why))
        return faults[-1]

    def transient(exc: BaseException) -> bool:
        return not any(exc is f for f in faults) and permanent_cause(exc) is None

    for attempt in Retrying(stop=stop_after_attempt(attempts), wait=wait_exponential(multiplier=0.5, max=wait_max_s),
                            retry=retry_if_exception(transient), reraise=True):
        with attempt:
            fetch_verified(fs, key, dest, meta, fault)
