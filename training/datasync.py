"""Cache a dataset from object storage onto local scratch: resumable (files already complete
are skipped), verified (every file's size against the bucket listing), atomic per file.

    python -m training.datasync s3://bucket/imagenet/ /scratch/datasets/current
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from training.storage import location

log = logging.getLogger("gts.datasync")


def sync(url: str, dest: str) -> tuple[int, int]:
    """Copy what is missing; return (files copied, files in the dataset)."""
    src = location(url)
    target = Path(dest)
    target.mkdir(parents=True, exist_ok=True)
    listing = src.fs.find(src.root, detail=True)
    copied = 0
    for path, info in sorted(listing.items()):
        if info.get("type") == "directory":
            continue
        rel = path[len(src.root):].lstrip("/")
        out = target / rel
        size = int(info.get("size") or 0)
        if out.exists() and out.stat().st_size == size:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        src.fs.get(path, str(part))
        if part.stat().st_size != size:
            raise OSError(f"{rel}: got {part.stat().st_size} bytes, the bucket lists {size}")
        os.replace(part, out)
        copied += 1
    total = sum(1 for i in listing.values() if i.get("type") != "directory")
    return copied, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("dest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    copied, total = sync(args.url, args.dest)
    log.info("dataset cache %s: %d of %d files copied, all %d verified by size", args.dest, copied, total, total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
