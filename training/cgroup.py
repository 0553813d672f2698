"""This process's memory cgroup (a Kubernetes pod, a container, a systemd unit): its limit and
usage, cgroup v2 then v1, read where /proc/self/cgroup says the process's own group is. Standard
library only: the peer store (training/ckpt/peer/store.py) reads it without the trainer's imports,
and the checkpoint fetch (training/ckpt/memory.py) reads the room left."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# (controller key in /proc/self/cgroup, mount, limit file, usage file): v2, then v1
CONTROLLERS = (("", "/sys/fs/cgroup", "memory.max", "memory.current"),
               ("memory", "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))


def memory_groups(proc: str = "/proc/self/cgroup") -> Iterator[tuple[int, Path, str]]:
    """(limit in bytes, the group's folder, its usage file) of each memory controller with a limit
    ("max" in v2 is none)."""
    try:
        groups = dict(line.split(":", 2)[1:] for line in Path(proc).read_text().splitlines())
    except (OSError, ValueError):
        return
    for key, root, limit_file, used_file in CONTROLLERS:
        if key not in groups:
            continue
        folder = Path(root) / groups[key].lstrip("/")
        try:
            limit = (folder / limit_file).read_text().strip()
        except OSError:
            continue  # no such controller here
        if limit.isdigit():
            yield int(limit), folder, used_file


def memory_limit(proc: str = "/proc/self/cgroup") -> int | None:
    """The smallest memory limit of this process's cgroups, None where there is none (a v1 limit
    past the machine's memory is a number, and `min` with the machine's makes it none)."""
    return min((limit for limit, _, _ in memory_groups(proc)), default=None)
