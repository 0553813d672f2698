"""How a manifest vouches for a file's bytes.

    "blake3_pieces": the BLAKE3 of the BLAKE3 digests (32 bytes each) of the file's 8 MiB
                     pieces, in order; the last piece may be shorter, an empty file has none.
                     Written by every commit since manifest format 3.
    "sha256_pieces": the same with sha256 (format 2, issue 34; still read and checked).
    "sha256":        the whole file's sha256 (format 1, still read; an entry that has it is
                     checked by it).

Why pieces: one sha256 stream runs at about 1 GB/s on one core here, slower than the disk's own
write + fsync of the same bytes (0.5 s per GB), so a checkpoint whose hash is one stream can
never be durable within 2x of the disk. Pieces hash independently: the writer hashes them on
helper threads while it writes (training/ckpt/staging.py), a reader on every core, and a download
(training/ckpt/fetch.py) in order as they arrive. Why BLAKE3 since format 3: about 8 GB/s a core
here against sha256's 2 (with the CPU's SHA extensions), and a resume hashes every byte it
fetches on the cores the download and the import of torch need as well (0.5 s per GB with
sha256). Every form is a cryptographic hash: a store cannot make other bytes match.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3

PIECE = 8 << 20
PIECES = "blake3_pieces"  # what this code writes
SHA256_PIECES = "sha256_pieces"  # format 2
KINDS = ("sha256", SHA256_PIECES, PIECES)  # an entry is checked by the first of these it has
FORMAT = 3  # the manifest format this code writes; it reads 1 to 3
WORKERS = max(1, min(4, os.cpu_count() or 1))


def hasher(kind: str = PIECES) -> Any:
    """A new hash object of `kind`: one piece's (blake3, sha256) or a sha256 stream's."""
    return blake3.blake3() if kind == PIECES else hashlib.sha256()


def combine(digests: list[bytes], kind: str = PIECES) -> str:
    whole = hasher(kind)
    whole.update(b"".join(digests))
    return str(whole.hexdigest())


def piece_digest(data: Any, kind: str = PIECES) -> bytes:
    piece = hasher(kind)
    piece.update(data)  # both release the GIL on large buffers
    return bytes(piece.digest())


def expected(meta: dict[str, Any]) -> tuple[str, str]:
    """(kind, hex digest) of a manifest entry: the first of KINDS it has."""
    for kind in KINDS:
        if isinstance(meta.get(kind), str):
            return kind, meta[kind]
    raise KeyError(PIECES)


def vouched(meta: Any) -> bool:
    """True for an entry with a size and a digest of a kind this code reads."""
    return (isinstance(meta, dict) and isinstance(meta.get("size"), int)
            and any(isinstance(meta.get(kind), str) for kind in KINDS))


class StreamHasher:
    """Hashes a stream of bytes in order, as `kind` says (one sha256, or per piece)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._hash = hasher(kind)
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
                self._hash, self._fill = hasher(self.kind), 0

    def hexdigest(self) -> str:
        if self.kind == "sha256":
            return str(self._hash.hexdigest())
        return combine(self._digests + ([self._hash.digest()] if self._fill else []), self.kind)


def _read_piece(fd: int, offset: int, kind: str) -> bytes:
    return piece_digest(os.pread(fd, PIECE, offset), kind)


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
            digests = list(pool.map(lambda offset: _read_piece(fd, offset, kind), range(0, size, PIECE)))
    finally:
        os.close(fd)
    return combine(digests, kind)


def matches(path: Path, meta: dict[str, Any]) -> bool:
    kind, want = expected(meta)
    return hash_file(path, kind) == want


def entry(path: Path) -> dict[str, Any]:
    """A manifest entry (this code's format) for a file on disk."""
    return {"size": path.stat().st_size, PIECES: hash_file(path)}
