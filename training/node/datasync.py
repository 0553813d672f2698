"""Copy a dataset between object stores and local disk: in parallel, resumable (files already
complete are skipped), verified (every file's size against the source listing), atomic per file.

On a node, the bootstrap caches the dataset on scratch; where the dataset ships as tar shards
(`<dataset>/shards/*.tar`), the shards are fetched and unpacked instead of millions of small files.
Run by hand, the same command puts a dataset into each cloud's bucket, so that every cloud's
nodes read it from their own cloud:

    python -m training.node.datasync s3://bucket/datasets/imagenet/ /scratch/datasets/current
    python -m training.node.datasync /data/imagenet/ oss://gts-prod-cn-hangzhou/datasets/imagenet/
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from training.ckpt.storage import Location, location

log = logging.getLogger("gts.datasync")
SHARDS = "shards"
DONE = ".gts-shards"  # in a local destination: one stamp per unpacked shard


@dataclass(frozen=True)
class Result:
    copied: int  # files (or shards) copied now
    total: int  # files (or shards) in the dataset
    sharded: bool
    seconds: float


def _listing(src: Location) -> dict[str, int]:
    """relative path -> size of every file under the source."""
    found = src.fs.find(src.root, detail=True)
    root = src.root.rstrip("/") + "/"
    return {path[len(root):]: int(info.get("size") or 0) for path, info in found.items()
            if info.get("type") != "directory" and path.startswith(root)}


def _copy(src: Location, dst: Location, rel: str, size: int) -> bool:
    """Copy one file unless the destination has it whole; True when copied."""
    target = dst.join(rel)
    try:
        if dst.fs.info(target).get("size") == size:
            return False
    except FileNotFoundError:
        pass
    if not dst.remote:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        part = target + ".part"
        src.fs.get(src.join(rel), part)
        got = os.path.getsize(part)
        if got != size:
            raise OSError(f"{rel}: got {got} bytes, the source lists {size}")
        os.replace(part, target)
        return True
    with src.fs.open(src.join(rel), "rb") as reader, dst.fs.open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, length=8 << 20)
    got = dst.fs.info(target).get("size")
    if got != size:
        raise OSError(f"{rel}: {dst.url} holds {got} bytes, the source lists {size}")
    return True


def _unpack_shard(src: Location, dest: Path, rel: str, size: int) -> bool:
    """Fetch one tar shard and unpack it into `dest`; stamped once whole."""
    stamp = dest / DONE / (Path(rel).name + ".done")
    if stamp.exists() and stamp.read_text().strip() == str(size):
        return False
    part = dest / DONE / (Path(rel).name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    src.fs.get(src.join(rel), str(part))
    if part.stat().st_size != size:
        raise OSError(f"{rel}: got {part.stat().st_size} bytes, the source lists {size}")
    with tarfile.open(part) as tar:
        tar.extractall(dest, filter="data")  # no absolute paths, links out or devices
    part.unlink()
    stamp.write_text(f"{size}\n")
    return True


def sync(source: str | Location, destination: str | Location, workers: int = 16) -> Result:
    """Copy what the destination lacks; raise if any file ends up with the wrong size. Either
    side may be a Location already (another cloud's endpoint and credentials than this
    process's environment names)."""
    started = time.monotonic()
    src = location(source) if isinstance(source, str) else source
    dst = location(destination) if isinstance(destination, str) else destination
    listing = _listing(src)
    shards = {rel: size for rel, size in listing.items() if rel.startswith(SHARDS + "/") and rel.endswith(".tar")}
    sharded = bool(shards) and not dst.remote
    if not dst.remote:
        Path(dst.root).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        if sharded:
            jobs = [pool.submit(_unpack_shard, src, Path(dst.root), rel, size) for rel, size in sorted(shards.items())]
        else:
            jobs = [pool.submit(_copy, src, dst, rel, size) for rel, size in sorted(listing.items())]
        copied = sum(1 for job in jobs if job.result())
    return Result(copied, len(shards) if sharded else len(listing), sharded, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="copy a dataset between object storage and local disk")
    parser.add_argument("source", help="s3://, oss://, cosn://, file:// URL or a local path")
    parser.add_argument("destination", help="a local path (a node's cache) or a bucket URL")
    parser.add_argument("--workers", type=int, default=16, help="files copied at once")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        result = sync(args.source, args.destination, args.workers)
    except (OSError, ValueError) as exc:
        log.error("dataset copy %s -> %s failed: %s (run it again: finished files are kept)",
                  args.source, args.destination, exc)
        return 1
    what = "shards" if result.sharded else "files"
    log.info("dataset %s -> %s: %d of %d %s copied in %.1f s, all %d verified by size", args.source,
             args.destination, result.copied, result.total, what, result.seconds, result.total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
