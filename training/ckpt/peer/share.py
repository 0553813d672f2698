"""One peer restore's full copy per node (issue 46): a node's local rank 0 fetches the chosen copy
once, checks it against its digest and writes it into a private file that its node's other ranks
read, instead of every rank pulling and unpickling the replicated state over HTTP itself.

The file lives in a directory made for this one restore (mkdtemp: a random name, mode 0700, in
/dev/shm when it is there and writable, else the node's scratch: the checkpoint manager's local
directory); the file itself is created with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, so that no
other user reads it and nothing planted there in advance is followed or written through. Every
reader checks the directory (a real one, ours, 0700), opens the file without following a link and
checks it is ours and 0600 (`open_copy`); once every rank holds it open, local rank 0 removes the
directory, and the readers hash it against the digest the copy's sender named and unpickle it
(weights only) from the open file (`load`): a file that does not match is refused by name, as a
bad peer copy is. The kernel frees the file's pages when the last reader closes it, also when a
worker is killed (SIGKILL leaves no `finally`). A worker killed between publishing and that
removal leaves its directory behind: local rank 0 sweeps this user's directories left by a dead
publisher (each publisher holds an flock on its directory while it lives) before it publishes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from typing import IO, Any

import torch

from training.ckpt.peer import wire

SHM = "/dev/shm"
PREFIX = "gts-peer-"
CHUNK = 8 << 20  # bytes read at a time while hashing


def default_root() -> str:
    """/dev/shm (memory, no disk write) where this process may write there, else ""."""
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK) else ""


class NodeCopy:
    """Local rank 0's side: a private directory for one restore, locked while this process lives,
    and the copy written into it once."""

    def __init__(self, root: str) -> None:
        self.dir = tempfile.mkdtemp(prefix=PREFIX, dir=root)  # a random name, mode 0700
        self._lock = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # released by the kernel when this process dies
        self.fetched = 0  # the bytes written into it

    def write(self, data: bytes | memoryview, name: str = "copy.pt") -> str:
        return self.write_parts([(0, data)], name, len(data))

    def write_parts(self, parts: Sequence[tuple[int, bytes | memoryview]], name: str, size: int) -> str:
        """A file of `size` bytes with each (offset, bytes) of `parts` in place, written once
        (O_EXCL); what no part covers is a hole, which nobody reads (a sharded restore fetches the
        pieces its ranks read: training/ckpt/peer/shardset.py)."""
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.truncate(size)
            for offset, data in parts:
                fh.seek(offset)
                fh.write(data)
                self.fetched += len(data)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def sweep(root: str, before: float) -> list[str]:
    """Remove this user's restore directories in `root` older than `before` whose publisher is
    gone (no flock held: it was killed before it removed them); returns those removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not _private(st, stat.S_IFDIR) or st.st_mtime >= before:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its publisher still lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def publish(data: bytes | memoryview, roots: list[str], before: float) -> tuple[NodeCopy, str]:
    """(the restore's directory, the file) holding `data`, in the first of `roots` with room (a
    container's /dev/shm may be small), after sweeping what dead publishers left there (`sweep`,
    older than `before`); OSError when none has room."""
    where = [r for r in dict.fromkeys(roots) if r]
    for root in where:
        sweep(root, before)
    failures = []
    for root in where:
        node_copy = None
        try:
            node_copy = NodeCopy(root)
            return node_copy, node_copy.write(data)
        except OSError as exc:
            if node_copy is not None:
                node_copy.remove()
            failures.append(f"{root}: {exc.strerror or exc}")
    raise OSError("no room to share it: " + "; ".join(failures or ["no place to write it"]))


def _private(st: os.stat_result, kind: int) -> bool:
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _where(path: str, what: str) -> str:
    return f"{what} shared on this node at {path}"


def open_copy(path: str, what: str) -> tuple[IO[bytes] | None, str]:
    """(the file at `path`, open, "") when it is the private file local rank 0 wrote; else (None,
    why: naming `what` and the file). Read it with `load` (the directory may be gone by then)."""
    try:
        if not _private(os.lstat(os.path.dirname(path)), stat.S_IFDIR):
            return None, f"{_where(path, what)}: its directory is not this user's private one: refused"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"{_where(path, what)} cannot be opened: {exc.strerror or exc}"
    fh = os.fdopen(fd, "rb")
    try:
        if _private(os.fstat(fd), stat.S_IFREG):
            return fh, ""
    except OSError:
        pass
    fh.close()
    return None, f"{_where(path, what)} is not a private file of this user (0600): refused"


def load(fh: IO[bytes], path: str, named: str, what: str) -> tuple[dict[str, Any] | None, str]:
    """(the copy in `fh`, "") when its bytes match `named` (the digest its sender named); else
    (None, why). Any failure is a refusal: every rank must go on to the ranks' vote."""
    try:
        hasher = wire.payload_hasher()
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
        if hasher.hexdigest() != named:
            return None, f"{_where(path, what)} does not match its digest: refused"
        fh.seek(0)
        return dict(torch.load(fh, map_location="cpu", weights_only=True)), ""
    except Exception as exc:  # noqa: BLE001 (a file that cannot be read or loaded: every rank must go on to the vote)
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        return None, f"{_where(path, what)} cannot be loaded: {first}"


def read(path: str, named: str, what: str) -> tuple[dict[str, Any] | None, str]:
    """`open_copy` then `load`: (the copy at `path`, "") or (None, why)."""
    fh, why = open_copy(path, what)
    if fh is None:
        return None, why
    with fh:
        return load(fh, path, named, what)
