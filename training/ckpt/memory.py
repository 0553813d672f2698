"""A step fetched for the only rank on its node goes to memory, not disk (issue 34: resume at
read speed). Each file is received into a memory file (memfd), hashed as it arrives
(training/ckpt/fetch.py), and training/ckpt/loader.py maps the model file shared, so its tensors
are the received pages: no write to disk, no read back, no copy on write when training updates
them in place. The pages belong to this process (and the DataLoader workers it forks, which
inherit the mapping and never write it); the descriptors are closed once the files are loaded.

No disk copy is kept: the step is in the bucket, and the rank's next checkpoint is written to
disk as usual; a rank that restarts on the node before then fetches it again. A node of several
ranks fetches to disk, where they share one copy; so does a step that would take more than half
the memory free (a state, or a manifest's claim, too big for memory: the disk's ENOSPC is a fault
the caller handles, an OOM kill is not) and a system that refuses memory files."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from training.cgroup import memory_groups
from training.ckpt.files import CheckpointError, Topology, plain_path, step_dir
from training.ckpt.fetch import fetch_retrying
from training.ckpt.storage import Location

log = logging.getLogger("gts.checkpoint")


def in_memory(topo: Topology) -> bool:
    """Whether a step this rank fetches goes to memory: the only rank on its node, on a system
    with memory files and a /proc to open them by."""
    return topo.local_world_size == 1 and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def memory_room() -> int:
    """Bytes this process may still take: the system's available memory, or less where its
    cgroup (a Kubernetes pod, a systemd unit) has a limit (v2: memory.max - memory.current; v1:
    memory.limit_in_bytes - memory.usage_in_bytes)."""
    room = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    for limit, folder, used_file in memory_groups():
        try:
            room = min(room, limit - int((folder / used_file).read_text()))
        except (OSError, ValueError):
            continue  # no usage figure: the system's
    return max(room, 0)


@contextlib.contextmanager
def memory_files(remote: Location, step: int, files: dict[str, dict[str, Any]], rank: int
                 ) -> Iterator[dict[str, Path] | None]:
    """Each of `files` (name -> manifest entry) of `step` fetched from `remote` into a memory file
    and checked: yields name -> a path that opens it (/proc/self/fd/N), and closes them on exit
    (a mapping made meanwhile keeps its pages; nothing else does). Yields None where the step goes
    to disk instead. Raises CheckpointError for a bad name or bytes, as the disk path does."""
    bad = [name for name in files if not plain_path(name)]
    if bad:
        raise CheckpointError(f"{bad[0]!r} is not a plain file name inside the step's folder")
    need, room = sum(int(meta["size"]) for meta in files.values()), memory_room()
    if need > room // 2:
        log.info("rank %d: %s needs %d MB, half of the %d MB of memory free is less; fetching it to disk",
                 rank, step_dir(step), need >> 20, room >> 20)
        yield None
        return
    held: dict[str, int] = {}
    try:
        try:
            for name in files:
                held[name] = os.memfd_create(f"gts-{step_dir(step)}-{name}", os.MFD_CLOEXEC)
        except OSError as exc:  # a sandbox without the call, or out of descriptors: before any GET
            log.info("rank %d: no memory file (%s); fetching %s to disk", rank, exc, step_dir(step))
            yield None
            return
        for name, meta in files.items():
            def fault(why: str, name: str = name) -> CheckpointError:
                return CheckpointError(f"{name} in {remote.url} {why}")
            with os.fdopen(held[name], "w+b", closefd=False) as fh:
                try:
                    fetch_retrying(remote.fs, remote.join(step_dir(step), name), fh, meta, fault)
                except CheckpointError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    raise CheckpointError(f"{name} cannot be fetched from {remote.url}: {exc}") from None
        yield {name: Path(f"/proc/self/fd/{fd}") for name, fd in held.items()}
    finally:
        for fd in held.values():
            os.close(fd)
