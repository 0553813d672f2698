"""The names and rules of a checkpoint on disk and in the bucket (training/ckpt/manager.py's
layout): step folders, manifests and the files they may list, the checks a manifest passes
before it is used, the topology a manager writes for, and a file checked against its manifest
entry (verify) and read as tensors and plain values only (unpickle)."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import shutil
import threading
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.ckpt import digest

if TYPE_CHECKING:
    import torch

STEP_RE = re.compile(r"^step-(\d{8})$")
MODEL_FILE = "model.pt"
# A file name a manifest may list: a plain name inside the step's folder (no path, no '..', no
# leading dot). Every name is checked before it is joined to a local path or a bucket key.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
# Inside a subfolder a leaf may also be a dot file (DCP's `.metadata`), never `.` or `..`.
DOT_LEAF = re.compile(r"^\.[A-Za-z0-9_][A-Za-z0-9._-]{0,198}$")
MAX_DEPTH = 8  # components of one listed path (a Trainer's FSDP folder has 2)
MAX_NODES = 4096
_MAP_FLAGS = threading.Lock()  # torch's mmap flags are process-wide: one mapped load at a time


def plain_path(name: object) -> bool:
    """True for a name a manifest may list: a relative POSIX path (`pytorch_model_fsdp_0/__0_0.distcp`)
    whose every component is a plain name (no '', '.', '..', leading '/', backslash or NUL; folders
    never dot names), whose leaf may be a dot file only inside a subfolder, and which is never a
    manifest. Checked before a name is joined to a local path or a bucket key; symbolic links on
    disk are refused separately (`inside`)."""
    if not isinstance(name, str) or "\\" in name or "\x00" in name:
        return False
    parts = name.split("/")
    if not 1 <= len(parts) <= MAX_DEPTH or not all(FILE_NAME.fullmatch(p) for p in parts[:-1]):
        return False
    leaf = parts[-1]
    if leaf.startswith("manifest-node"):
        return False
    return bool(FILE_NAME.fullmatch(leaf) or (len(parts) > 1 and DOT_LEAF.fullmatch(leaf)))


def inside(folder: Path, name: str) -> Path:
    """`folder/name` for a listed name, after checking that the name is a plain path and that no
    component of it on disk (nor the folder) is a symbolic link and it resolves inside `folder`;
    else CheckpointError."""
    if not plain_path(name):
        raise CheckpointError(f"{name!r} is not a plain file name inside the step's folder")
    path = folder
    for part in [None, *name.split("/")]:
        path = path if part is None else path / part
        if path.is_symlink():
            raise CheckpointError(f"{folder.name}/{name} is a symbolic link: a checkpoint holds files only")
    if folder.exists() and not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{folder.name}/{name} resolves outside the step's folder")
    return path


def tree_files(folder: Path) -> list[str]:
    """The files under `folder` as relative POSIX paths, sorted; CheckpointError when one is a
    symbolic link (file or folder) or neither a file nor a folder. Never follows a link."""
    found = []
    for here, dirs, names in os.walk(folder, followlinks=False):
        base = Path(here)
        for entry in sorted(dirs) + sorted(names):
            path = base / entry
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                raise CheckpointError(f"{folder}/{rel} is a symbolic link: a checkpoint holds files only")
            if path.is_file():
                found.append(rel)
            elif not path.is_dir():
                raise CheckpointError(f"{folder}/{rel} is not a file or a folder")
    return sorted(found)


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def manifest_name(node: int) -> str:
    return f"manifest-node{node:03d}.json"


def rng_name(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def run_key(url: str) -> str:
    """The local cache folder of a run: readable, and unique per checkpoint URL."""
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", url.split("://", 1)[-1]).strip("_")[-60:]
    return f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"


class CheckpointError(Exception):
    """A step that cannot be used (the message says which file and why)."""


def check_manifest(manifest: Any, step: int, where: str) -> dict[str, Any]:
    """`manifest` if it is one of `step` whose every file lies in the step's folder; else
    CheckpointError naming what is wrong (a hostile or hand-edited manifest is never used)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{where}: not a manifest")
    if manifest.get("step") != step:
        raise CheckpointError(f"{where} is the manifest of step {manifest.get('step')!r}, not of {step_dir(step)} "
                              "(a renamed or copied folder): not used")
    version = manifest.get("format", 1)
    if not isinstance(version, int) or version > digest.FORMAT:
        raise CheckpointError(f"{where} has manifest format {version!r}; this version of training/ reads formats "
                              f"1 to {digest.FORMAT}: resume it with the version that wrote it, or a newer one")
    nnodes = manifest.get("nnodes", 1)
    if not isinstance(nnodes, int) or not 1 <= nnodes <= MAX_NODES:
        raise CheckpointError(f"{where}: nnodes {nnodes!r} is not a node count")
    for name, meta in manifest["files"].items():
        if not plain_path(name):
            raise CheckpointError(f"{where} lists {name!r}: not a plain file name inside the step's folder; "
                                  "the step is not used")
        if not digest.vouched(meta):
            raise CheckpointError(f"{where}: the entry of {name!r} has no size and sha256")
    return manifest


class RunLocked(Exception):
    """Another trainer holds this run's checkpoint folder."""


def _sparse_parts(value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors torch.save writes for a sparse one: a COO tensor's indices and values, a
    compressed one's (CSR, CSC, BSR, BSC) compressed and plain indices and values; () for another
    layout without a storage."""
    import torch

    if value.layout == torch.sparse_coo:
        return value._indices(), value._values()
    if value.layout in (torch.sparse_csr, torch.sparse_bsr):
        return value.crow_indices(), value.col_indices(), value.values()
    if value.layout in (torch.sparse_csc, torch.sparse_bsc):
        return value.ccol_indices(), value.row_indices(), value.values()
    return ()


def storage_sizes(state: Any) -> dict[int, int]:
    """The storages torch.save writes for the tensors in `state` (nested mappings, lists, tuples),
    each once however many tensors view it, by key: their bytes (whole storages: torch.save writes
    a view's whole storage). Containers are walked once (one that holds itself ends the walk). A
    sparse tensor is the tensors torch.save writes for it (`_sparse_parts`), not its dense size;
    another layout without a storage counts its elements. Tensors inside other objects are not
    seen."""
    return {key: size for key, size, _ in _storages(state)}


def cpu_spans(state: Any) -> list[tuple[int, int]]:
    """(address, bytes) of the non-empty storages in host memory that torch.save writes for
    `state` (as storage_sizes finds them): the memory its writes of tensor bytes come from."""
    return [(storage.data_ptr(), size) for _, size, storage in _storages(state)
            if storage is not None and size and storage.device.type == "cpu"]


def _storages(state: Any) -> Iterator[tuple[int, int, torch.UntypedStorage | None]]:
    """(key, bytes, storage or None) of each storage of storage_sizes, once."""
    import torch

    keys: set[int] = set()
    seen: set[int] = set()
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
            except NotImplementedError:  # "Cannot access storage of SparseTensorImpl"
                parts = _sparse_parts(value)
                if parts:
                    stack.extend(parts)
                elif id(value) not in keys:
                    keys.add(id(value))
                    yield id(value), value.nelement() * value.element_size(), None
                continue
            key = storage.data_ptr() or id(value)  # empty storages share address 0
            if key not in keys:
                keys.add(key)
                yield key, storage.nbytes(), storage
        elif isinstance(value, (Mapping, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values() if isinstance(value, Mapping) else value)


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in `state` (nested dicts, lists): about what its file takes."""
    return sum(storage_sizes(state).values())


def mount_of(path: Path) -> Path:
    """The mount point of the file system `path` is on."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 19 else f"{n / 1024:.1f} KiB"


def write_failure(exc: BaseException, folder: Path, needed: int | None) -> str:
    """Why a step could not be written, for a person: a full disk is named as such (torch's
    serialiser reports ENOSPC as its own `file write failed`), with the mount point, what the
    step needed and what is free."""
    seen: set[int] = set()
    current: BaseException | None = exc
    nospace = False
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        nospace = nospace or getattr(current, "errno", None) == errno.ENOSPC
        current = current.__cause__ or current.__context__
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = -1
    if nospace or (needed is not None and 0 <= free < needed + (1 << 20)):
        need = f"about {_size(needed)}" if needed is not None else "more than that"
        return (f"the disk holding {folder} (the file system mounted at {mount_of(folder)}) is full: the step needed "
                f"{need}, {_size(max(free, 0))} free ({type(exc).__name__}: {exc}); free space there, "
                "lower KEEP_CHECKPOINTS or point CHECKPOINT_DIR at a larger disk")
    return f"{type(exc).__name__}: {exc}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def link_or_copy(src: str, dst: str) -> None:
    """A hard link (no second copy of a large file) where the file system allows one."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def fsync_path(path: Path) -> None:
    """fsync a folder (its entries) or a file, by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path  # the name for a folder's entries


@dataclass(frozen=True)
class Topology:
    rank: int
    local_rank: int
    world_size: int
    node: int
    nnodes: int
    local_world_size: int

    @property
    def node_ranks(self) -> range:
        return range(self.node * self.local_world_size, (self.node + 1) * self.local_world_size)


@dataclass
class UploadStatus:
    pending: list[int] = field(default_factory=list)
    last_success: float = 0.0
    last_error: str = ""
    uploaded: list[int] = field(default_factory=list)
    last_commit: float = 0.0  # when the newest checkpoint was committed locally
    write_error: str = ""  # why the last background write failed ("" when it did not)
    permanent_error: str = ""  # the store's answer no retry changes (URL: Code: message), if any

    def snapshot(self) -> UploadStatus:
        """A copy whose lists are its own (the uploader's thread changes this one's, under its lock)."""
        return replace(self, pending=list(self.pending), uploaded=list(self.uploaded))


def verify(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    """Each file's size and sha256 against its manifest entry."""
    for name, meta in files.items():
        path = inside(folder, name)  # a plain relative path, no symbolic link on the way
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{name} is missing") from None
        if size != meta["size"]:
            raise CheckpointError(f"{name} has {size} bytes, the manifest says {meta['size']}")
        if not digest.matches(path, meta):
            raise CheckpointError(f"{name} does not match its digest in the manifest")


def unpickle(path: Path, name: str | None = None, mapped: int | None = None) -> dict[str, Any]:
    """The file's tensors and plain values, with weights_only: a checkpoint in a shared bucket
    must not be able to run code when loaded; a damaged file and one carrying code both fail
    here (CheckpointError), and neither is ever used.

    `mapped` (mmap flags) maps the file instead of reading it: MAP_SHARED for a memory file
    of training/ckpt/memory.py (its own pages: no copy at all), MAP_PRIVATE for a file
    on disk whose tensors go to an accelerator (`for_device`: the copy to the device reads the
    page cache, and the file is only ever replaced by rename or removed, which a mapping
    outlives). A file torch cannot map (an old non-zip one, or no mapping to be had) is read.
    Otherwise read (issue 34): a private mapping costs a copy-on-write fault per page when the
    first steps write the parameters and moments in place, about 1.3 s per GB over two steps
    against 0.44 s for the read."""
    import torch  # here, not at the top: the fetch process (training/ckpt/fetch_process.py) never imports it

    if mapped is not None:
        try:
            # torch reads the flags from a process-wide setting: one load of ours at a time
            # sets it, and nothing else here loads with mmap=True meanwhile.
            with _MAP_FLAGS, torch.serialization.set_default_mmap_options(mapped):
                return dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, TypeError):
            pass  # read below: a bad file fails there too, and says why
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as exc:
        text = str(exc)
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0] if text.strip() else ""
        raise CheckpointError(f"{name or path.name} cannot be read as tensors and plain values: "
                              f"{detail[:160]}") from None
