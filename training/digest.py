"""How a manifest vouches for a file's bytes.

    "sha256_pieces": the sha256 of the sha256 digests (32 bytes each) of the file's 8 MiB
                     pieces, in order; the last piece may be shorter, an empty file has none.
                     Written by every commit since manifest format 2 (issue 34).
    "sha256":        the whole file's sha256 (format 1, still read; an entry that has it is
                     checked by it).

Why pieces: one sha256 stream runs at about 1 GB/s on one core here, slower than the disk's own
write + fsync of the same bytes (0.5 s per GB), so a checkpoint whose hash is one stream can
never be durable within 2x of the disk. Pieces hash independently: the writer hashes them on
helper threads while it writes (training/staging.py), a reader on every core, and a download
(training/fetch.py) in order as they arrive. Both forms are as strong as sha256 itself.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PIECE = 8 << 20
PIECES = "sha256_pieces"
FORMAT = 2  # the manifest format this code writes; it reads 1 and 2
WORKERS = max(1, min(4, os.cpu_count() or 1))


def combine(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def piece_digest(data: Any) -> bytes:
    return hashlib.sha256(data).digest()  # releases the GIL on buffers over 2 KB


def expected(meta: dict[str, Any]) -> tuple[str, str]:
    """(kind, hex digest) of a manifest entry: ("sha256", …) or (PIECES, …)."""
    if isinstance(meta.get("sha256"), str):
        return "sha256", meta["sha256"]
    return PIECES, meta[PIECES]


def vouched(meta: Any) -> bool:
    """True for an entry with a size and a digest of either kind."""
    return (isinstance(meta, dict) and isinstance(meta.get("size"), int)
            and (isinstance(meta.get("sha256"), str) or isinstance(meta.get(PIECES), str)))


class StreamHasher:
    """Hashes a stream of bytes in order, as `kind` says (one sha256, or per piece)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._hash = hashlib.sha256()
        self._fill = 0
        self._digests: list[bytes] = []

    def update(self, data: Any) -> None:
        if self.kind == "sha256":
            self._hash.update(data)
            return
        view = memoryview(data).cast("B")
        while len(view):
            take = min(PIECE - self._fill, len(view))
            self._hash.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == PIECE:
                self._digests.append(self._hash.digest())
                self._hash, self._fill = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        if self.kind == "sha256":
            return self._hash.hexdigest()
        return combine(self._digests + ([self._hash.digest()] if self._fill else []))


def _read_piece(fd: int, offset: int) -> bytes:
    return piece_digest(os.pread(fd, PIECE, offset))


def hash_file(path: Path, kind: str = PIECES) -> str:
    """The digest of a file on disk: by pieces on WORKERS threads, or one sha256 stream."""
    if kind == "sha256":
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        return digest.hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="checkpoint-hash") as pool:
            digests = list(pool.map(lambda offset: _read_piece(fd, offset), range(0, size, PIECE)))
    finally:
        os.close(fd)
    return combine(digests)


def matches(path: Path, meta: dict[str, Any]) -> bool:
    kind, want = expected(meta)
    return hash_file(path, kind) == want


def entry(path: Path) -> dict[str, Any]:
    """A format-2 manifest entry for a file on disk."""
    return {"size": path.stat().st_size, PIECES: hash_file(path)}
