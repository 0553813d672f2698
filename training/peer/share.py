"""One peer restore's full copy per node (issue 46): a node's local rank 0 fetches the chosen copy
once, checks it against its digest and writes it into a private file that its node's other ranks
read, instead of every rank pulling and unpickling the replicated state over HTTP itself.

The file lives in a directory made for this one restore (mkdtemp: a random name, mode 0700, in
/dev/shm when it is there and writable, else the temp directory); the file itself is created with
O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, so that no other user reads it and nothing planted
there in advance is followed or written through. Every reader checks the directory (a real one,
ours, 0700), opens the file without following a link, checks it is ours and 0600, and hashes it
against the digest the copy's sender named before unpickling it (weights only): a file that does
not match is refused by name, as a bad peer copy is. The directory goes when the restore ends,
also on an error (`remove`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import stat
import tempfile
import zipfile
from typing import Any

import torch

from training.peer import wire

log = logging.getLogger("gts.peer")
SHM = "/dev/shm"
CHUNK = 8 << 20  # bytes read at a time while hashing


def default_root() -> str:
    """/dev/shm (memory, no disk write) where this process may write there, else the temp dir."""
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK) else tempfile.gettempdir()


class NodeCopy:
    """Local rank 0's side: a private directory for one restore, and the copy written into it once."""

    def __init__(self, root: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="gts-peer-", dir=root)  # a random name, mode 0700

    def write(self, data: bytes | memoryview) -> str:
        path = os.path.join(self.dir, "copy.pt")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def publish(data: bytes | memoryview, root: str) -> tuple[NodeCopy, str]:
    """(the restore's directory, the file) holding `data`, in `root`, else in the temp dir where
    `root` has no room (a container's small /dev/shm); OSError when neither has."""
    failures = []
    for where in dict.fromkeys((root, tempfile.gettempdir())):
        node_copy = None
        try:
            node_copy = NodeCopy(where)
            return node_copy, node_copy.write(data)
        except OSError as exc:
            if node_copy is not None:
                node_copy.remove()
            failures.append(f"{where}: {exc.strerror or exc}")
    raise OSError("no room to share it: " + "; ".join(failures))


def _private(st: os.stat_result, kind: int) -> bool:
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & 0o077


def read(path: str, named: str, what: str) -> tuple[dict[str, Any] | None, str]:
    """(the copy at `path`, "") when it is the private file local rank 0 wrote and its bytes match
    `named` (the digest its sender named); else (None, why: naming `what` and the file)."""
    where = f"{what} shared on this node at {path}"
    try:
        if not _private(os.lstat(os.path.dirname(path)), stat.S_IFDIR):
            return None, f"{where}: its directory is not this user's private one: refused"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"{where} cannot be opened: {exc.strerror or exc}"
    with os.fdopen(fd, "rb") as fh:
        if not _private(os.fstat(fd), stat.S_IFREG):
            return None, f"{where} is not a private file of this user (0600): refused"
        hasher = wire.payload_hasher()
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
        if hasher.hexdigest() != named:
            return None, f"{where} does not match its digest: refused"
        fh.seek(0)
        try:  # the file object already opened and checked: no second lookup of the path
            return dict(torch.load(fh, map_location="cpu", weights_only=True)), ""
        except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as exc:
            return None, f"{where} cannot be loaded: {str(exc).strip().splitlines()[0][:160] if str(exc) else exc}"
