"""A run's newest committed checkpoint (and its dataset, when the other bucket lacks it) copied
from one cloud's bucket to another's, verified: every file streams through the digest its
manifest names (training/ckpt/digest.py) on the way out and is read back and hashed again on the
other side; the manifests go last, so the step is committed there only once every file is in
and checked (the layout is training/ckpt/files.py's). Storage is training/ckpt/storage.py's
(s3://, oss://, cosn://, file://)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from training.ckpt import digest
from training.ckpt.files import STEP_RE, CheckpointError, check_manifest, manifest_name, step_dir
from training.ckpt.storage import Location

CHUNK = 8 << 20


@dataclass(frozen=True)
class Progress:
    """Where the run is, as its bucket shows it."""

    committed: int | None  # the newest step whose every node's manifest is in
    writing: int | None  # a newer step folder without all its manifests: a checkpoint being written
    abandoned: list[int] = field(default_factory=list)  # newer incomplete steps nobody writes any more


@dataclass(frozen=True)
class Copied:
    step: int | None
    files: int
    bytes: int
    dataset_files: int
    dataset_bytes: int


class CopyError(RuntimeError):
    """A file that did not arrive as its manifest says (the message names it)."""


def _manifests(loc: Location, step: int) -> list[dict[str, Any]] | None:
    """The step's node manifests, checked; None when one is missing."""
    folder = loc.join(step_dir(step))
    try:
        first = check_manifest(json.loads(loc.fs.cat(f"{folder}/{manifest_name(0)}")), step, f"{loc.url}/{step_dir(step)}")
        rest = [check_manifest(json.loads(loc.fs.cat(f"{folder}/{manifest_name(n)}")), step, f"{loc.url}/{step_dir(step)}")
                for n in range(1, int(first.get("nnodes", 1)))]
    except (FileNotFoundError, ValueError, CheckpointError):
        return None
    return [first, *rest]


def _newest(loc: Location, step: int) -> datetime | None:
    """When the newest object of a step folder was written (S3's LastModified, a file's mtime)."""
    try:
        found = loc.fs.find(loc.join(step_dir(step)), detail=True)
    except FileNotFoundError:
        return None
    stamps = []
    for info in found.values():
        when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
        if isinstance(when, datetime):
            stamps.append(when if when.tzinfo else when.replace(tzinfo=timezone.utc))
        elif isinstance(when, (int, float)):
            stamps.append(datetime.fromtimestamp(when, timezone.utc))
    return max(stamps, default=None)


def progress(loc: Location, now: datetime | None = None, stale_after_s: float | None = None,
             writers: bool = True) -> Progress:
    """The newest committed step, and a newer incomplete one being written. An incomplete step is
    abandoned (a crash mid-upload), not being written, when no node of the group runs
    (`writers` False) or its newest object is older than `stale_after_s` at `now`."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in loc.fs.ls(loc.root, detail=False)]
    except FileNotFoundError:
        return Progress(None, None)
    steps = sorted((int(m.group(1)) for n in names if (m := STEP_RE.match(n))), reverse=True)
    newest = next((s for s in steps if _manifests(loc, s) is not None), None)
    writing, abandoned = None, []
    for step in (s for s in steps if newest is None or s > newest):
        last = _newest(loc, step) if writers and now is not None and stale_after_s is not None else None
        if not writers or (last is not None and now is not None and stale_after_s is not None
                           and (now - last).total_seconds() > stale_after_s):
            abandoned.append(step)
        elif writing is None:
            writing = step
    return Progress(newest, writing, abandoned)


def _stream(src: Location, src_path: str, dst: Location, dst_path: str, meta: dict[str, Any]) -> int:
    kind, want = digest.expected(meta)
    hasher, size = digest.StreamHasher(kind), 0
    with src.fs.open(src_path, "rb") as fin, dst.fs.open(dst_path, "wb") as fout:
        for block in iter(lambda: fin.read(CHUNK), b""):
            hasher.update(block)
            size += len(block)
            fout.write(block)
    if size != meta["size"] or hasher.hexdigest() != want:
        raise CopyError(f"{src.url}: {src_path} is {size} bytes with {kind} {hasher.hexdigest()[:16]}…, not the "
                        f"manifest's {meta['size']} bytes {want[:16]}…: not copied")
    again, back = digest.StreamHasher(kind), 0
    with dst.fs.open(dst_path, "rb") as fin:
        for block in iter(lambda: fin.read(CHUNK), b""):
            again.update(block)
            back += len(block)
    if back != size or again.hexdigest() != want:
        raise CopyError(f"{dst.url}: {dst_path} reads back as {back} bytes {again.hexdigest()[:16]}…, not what was "
                        "written: the copy is not committed")
    return size


def copy_step(src: Location, dst: Location, step: int) -> tuple[int, int]:
    """(files, bytes) of `step` copied and verified; its manifests written last."""
    manifests = _manifests(src, step)
    if manifests is None:
        raise CopyError(f"{src.url}/{step_dir(step)} is not committed (a manifest is missing): not copied")
    files, total = 0, 0
    for manifest in manifests:
        for name, meta in manifest["files"].items():
            rel = f"{step_dir(step)}/{name}"
            total += _stream(src, src.join(rel), dst, dst.join(rel), meta)
            files += 1
    for n, manifest in enumerate(manifests):
        dst.fs.pipe(dst.join(step_dir(step), manifest_name(n)), json.dumps(manifest).encode())
    return files, total


SAFE_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,1023}$")


def copy_dataset(src: Location, dst: Location) -> tuple[int, int]:
    """(files, bytes) of a dataset folder copied where the other bucket has none of it (a
    dataset already there is left alone), each file hashed on both sides."""
    try:
        if dst.fs.find(dst.root):
            return 0, 0
    except FileNotFoundError:
        pass
    try:
        found = sorted(src.fs.find(src.root))
    except FileNotFoundError:
        return 0, 0
    files, total = 0, 0
    for path in found:
        rel = path[len(src.root.rstrip("/")) + 1:] if path.startswith(src.root.rstrip("/") + "/") else ""
        if not SAFE_KEY.fullmatch(rel) or ".." in rel.split("/"):
            raise CopyError(f"{src.url}: {path!r} is not a plain key under the dataset's folder: not copied")
        whole = digest.StreamHasher("sha256")
        with src.fs.open(path, "rb") as fin:
            for block in iter(lambda: fin.read(CHUNK), b""):
                whole.update(block)
        meta = {"size": int(src.fs.size(path)), "sha256": whole.hexdigest()}
        total += _stream(src, path, dst, dst.join(rel), meta)
        files += 1
    return files, total
