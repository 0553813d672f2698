"""Finding and loading committed steps (the Loader a CheckpointManager holds): the steps on this
disk and in the bucket, every file checked against its manifest before it is unpickled (with
weights_only), a bad or missing local copy fetched again from the bucket in one pass, and the
newest step prefetched while the caller builds its model. The disk and the bucket are two tiers
(training/ckpt/tiers.py) over it: DiskTier and BucketTier."""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.ckpt.files import (MODEL_FILE, STEP_RE, CheckpointError, Topology, check_manifest, inside,
                                 manifest_name, plain_path, rng_name, step_dir, unpickle, verify)
from training.ckpt.memory import in_memory, memory_files
from training.ckpt import fetch_process
from training.ckpt.fetch import fetch_retrying
from training.ckpt.prefetch import Prefetch
from training.ckpt.storage import Location, StorageRefused, StorageUnavailable, permanent_cause

log = logging.getLogger("gts.checkpoint")


def owner_entries(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each listed file's entry in the manifest of the node that wrote it. Every node lists its
    own `model.pt` (its local rank 0 writes one), but the bucket holds global rank 0's, node 0's
    (training/ckpt/uploader.py); a folder fetched from the bucket holds that one too, and a
    folder a node wrote itself holds its own manifest alone. So the first manifest in node order
    that lists a name is its writer's: a file is never checked against another node's entry
    (which differs wherever anything per node is inside the file: issue 46)."""
    owners: dict[str, dict[str, Any]] = {}
    for manifest in manifests:  # in node order, as both readers below list them
        for name, meta in manifest.get("files", {}).items():
            owners.setdefault(name, meta)
    return owners


class Loader:
    """Finding and loading the steps of one manager's folder and bucket (CheckpointManager holds
    one). `wait_commit` is the manager's: a step being written is committed before it is listed."""

    def __init__(self, local: Path, remote: Location | None, topo: Topology, for_device: bool,
                 wait_commit: Callable[[], None]):
        self.local, self.remote, self.topo = local, remote, topo
        self.for_device = for_device  # the loaded state is copied to an accelerator: map the model file, do not read it
        self.wait_commit = wait_commit
        self.remote_error = ""  # why the bucket could not be listed, if it could not
        self._told: set[str] = set()  # warnings already logged (a bad folder is named once)
        self.prefetched = Prefetch(self)  # the newest step, loaded while the caller builds its model
        self._handed: list[int] | None = None  # the fetch process's listing, kept for `listed`

    @property
    def told(self) -> list[str]:
        """The warnings this loader gave (a fetch process hands them to the training process)."""
        return sorted(self._told)

    def local_manifests(self, step: int) -> list[dict[str, Any]]:
        """The step's manifests on this disk that are its own (see check_manifest); one that is
        not is logged once and makes the step not committed here."""
        folder = self.local / step_dir(step)
        found = []
        for path in sorted(folder.glob("manifest-node*.json")):
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                self._damaged(step, f"{folder.name}/{path.name} on this node", exc)
                continue
            try:
                found.append(check_manifest(manifest, step, f"{folder.name}/{path.name}"))
            except CheckpointError as exc:
                if str(exc) not in self._told:
                    self._told.add(str(exc))
                    log.warning("%s", exc)
                return []
        return found

    def _damaged(self, step: int, where: str, exc: Exception) -> None:
        """One line, once, for a manifest that cannot be read: the step is not used from there."""
        fault = f"not JSON ({exc})" if isinstance(exc, ValueError) else f"unreadable ({exc})"
        then = ("the bucket's copy of the step is used if it is good, else the step before it"
                if self.remote is not None and "on this node" in where else "the step before it is used")
        line = f"skipping checkpoint step {step}: its manifest {where} is damaged: {fault}; {then}"
        if line not in self._told:
            self._told.add(line)
            log.warning("%s", line)

    def local_steps(self) -> list[int]:
        """Committed steps on this node's disk (a manifest of that step is in: the step is the
        manifest's, never the folder name's; checked file by file on load)."""
        self.wait_commit()
        steps = [int(m.group(1)) for p in self.local.iterdir() if (m := STEP_RE.match(p.name)) and not p.is_symlink()]
        return sorted(s for s in steps if self.local_manifests(s))

    def remote_steps(self) -> list[int]:
        """Steps whose every node's manifest is in the bucket. An unreachable bucket gives none,
        and a listed step whose manifest cannot be read (other than missing) is left out: both set
        `remote_error` (why), so that choose_checkpoint never takes "none listed" for "none there"."""
        if self.remote is None:
            return []
        handed = self.prefetched.listing()  # the fetch process's, once, when its step was taken (no store opened here)
        if handed is not None:
            self.remote_error = str(handed.get("error") or "")
            for line in handed.get("told", []):
                if line not in self._told:
                    self._told.add(line)
                    log.warning("%s", line)
            self._handed = sorted(int(step) for step in handed["steps"])
            return list(self._handed)
        self.remote_error, self._handed = "", None
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.remote.fs.ls(self.remote.root, detail=False)]
        except Exception as exc:  # noqa: BLE001 (botocore / aiohttp errors are not all OSError)
            cause = permanent_cause(exc)
            if cause is not None:  # no retry helps: say so now, not after minutes of retries
                raise StorageRefused(f"{self.remote.url}: {cause}") from None
            if isinstance(exc, FileNotFoundError):
                return []  # nothing under the prefix yet
            self.remote_error = f"{type(exc).__name__}: {exc}"
            return []
        found = []
        for name in names:
            m = STEP_RE.match(name)
            if not m:
                continue
            try:
                listing = {p.rsplit("/", 1)[-1] for p in self.remote.fs.ls(self.remote.join(name), detail=False)}
                raw = self.remote.fs.cat(self.remote.join(name, manifest_name(0)))
            except FileNotFoundError:  # a missing manifest: not a complete step
                continue
            except Exception as exc:  # noqa: BLE001 (a 503, a dropped connection: the step may well be there)
                self.remote_error = f"{name}/{manifest_name(0)}: {type(exc).__name__}: {exc}"
                continue
            try:
                first = json.loads(raw)
            except ValueError as exc:
                self._damaged(int(m.group(1)), f"{self.remote.url}/{name}/{manifest_name(0)}", exc)
                continue
            try:
                check_manifest(first, int(m.group(1)), f"{self.remote.url}/{name}/{manifest_name(0)}")
            except CheckpointError as exc:
                if str(exc) not in self._told:
                    self._told.add(str(exc))
                    log.warning("%s", exc)
                continue
            if all(manifest_name(n) in listing for n in range(int(first["nnodes"]))):
                found.append(int(m.group(1)))
        return sorted(found)

    def listed(self) -> list[int]:
        """The bucket's steps: the listing a fetch process handed over for the resume, once more
        (the start-up's resync, right after it: the store need not be opened for it), else listed now."""
        handed, self._handed = self._handed, None
        return handed if handed is not None else self.remote_steps()

    def loadable_steps(self) -> set[int]:
        """Steps this node may restore, from its disk or the bucket (checked when loaded)."""
        return set(self.local_steps()) | set(self.remote_steps())

    def prefetch(self, early_only: bool = False) -> None:
        """Start loading the newest step (local or in the bucket: fetched, checked, loaded) in the
        background (training/ckpt/prefetch.py), so that it overlaps what the caller does next
        (imports, building the model). `load` of that step then returns its result; a fault found
        there is not kept: `load` tries again and reports it as usual. `early_only`: only where
        `prefetch` (training/ckpt/fetch_process.py) started a fetch of this bucket before the
        loader existed (the manager takes it as it is made, whichever path resumes)."""
        if not early_only or (self.remote is not None and fetch_process.early(self.remote.url)):
            self.prefetched.start()
        else:
            fetch_process.drop()  # one made for another URL (or none for this one): not held for the run

    def end_prefetch(self) -> None:
        """The caller has resumed (or chose no step): a prefetched state nobody took, now or when
        the prefetch finishes, is dropped instead of being held (a whole state's memory) for the
        run, and a fetch still under way is stopped."""
        self.prefetched.end()

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(model state, this rank's RNG state or None when the step was saved with another
        world size) for `step`: every file checked against its manifest first; a bad local copy
        is fetched again from the bucket. Raises CheckpointError naming the file and the fault."""
        prefetched = self.prefetched.take(step)
        if prefetched is not None:
            return prefetched
        self.wait_commit()
        try:
            files = self._checked_here(step)
        except CheckpointError as local_fault:
            if self.remote is None:
                raise
            return self.load_remote(step, local_fault)
        return self._read(self.local / step_dir(step), files)

    def load_local(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """`load` from this node's disk alone (DiskTier): CheckpointError where a file is missing or bad."""
        self.wait_commit()
        return self._read(self.local / step_dir(step), self._checked_here(step))

    def load_remote(self, step: int, local_fault: CheckpointError | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """`load` from the bucket (BucketTier; `load` after `local_fault`, the local copy's): the
        files missing or bad here fetched, each checked as it arrives, or held in memory where this
        node has nothing of the step and one rank."""
        assert self.remote is not None
        folder = self.local / step_dir(step)
        here = bool(self.local_manifests(step))
        if here and local_fault is not None:
            log.warning("rank %d: local %s is damaged (%s); fetching it from %s", self.topo.rank,
                        step_dir(step), local_fault, self.remote.url)
        files = self.remote_files(step)
        if not here and in_memory(self.topo):  # nothing of this step here, and no other rank to share it
            loaded = self._load_in_memory(step, files)
            if loaded is not None:
                return loaded
        self._download(step, folder, files)  # each file checked there (fetched and hashed, or already good)
        return self._read(folder, files)

    def _checked_here(self, step: int) -> dict[str, dict[str, Any]]:
        """The files this rank loads of `step`, each checked on this node's disk."""
        files, _ = self._needed(self.local_manifests(step))
        verify(self.local / step_dir(step), files)
        return files

    def _read(self, folder: Path, files: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        model = unpickle(folder / MODEL_FILE, mapped=mmap.MAP_PRIVATE if self.for_device else None)
        rng = unpickle(folder / rng_name(self.topo.rank)) if rng_name(self.topo.rank) in files else None
        return model, rng

    def wait_prefetch(self) -> None:
        """Until the prefetch (if one started) has finished: no fetch left half-written, and none
        that `prefetch` started and nobody took left running."""
        self.prefetched.wait()
        fetch_process.drop()

    def load_folder(self, step: int) -> Path:
        """A step saved with `save_folder`, every file of every node checked (fetched from the
        bucket where missing or bad here): the local folder holding them."""
        self.wait_commit()
        folder = self.local / step_dir(step)
        manifests = self.local_manifests(step)
        try:
            files = self._all_files(manifests)
            verify(folder, files)
        except CheckpointError:
            if self.remote is None:
                raise
            manifests = self._remote_manifests(step)
            files = self._all_files(manifests)
            self._download(step, folder, files)  # each file checked there
        return folder

    def _all_files(self, manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not manifests or len(manifests) < int(manifests[0].get("nnodes", 1)):
            raise CheckpointError("the manifests of some nodes are missing")
        return {name: meta for m in manifests for name, meta in m.get("files", {}).items()}

    def _needed(self, manifests: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], int]:
        """The files this rank loads, with their manifest entries, and the step's world size."""
        if not manifests:
            raise CheckpointError("no manifest")
        world = int(manifests[0].get("world_size", self.topo.world_size))
        listed = owner_entries(manifests)
        wanted = [MODEL_FILE] + ([rng_name(self.topo.rank)] if world == self.topo.world_size else [])
        missing = [name for name in wanted if name not in listed]
        if missing:
            raise CheckpointError(f"the manifest lists no {', '.join(missing)}")
        return {name: listed[name] for name in wanted}, world

    def _load_in_memory(self, step: int, files: dict[str, dict[str, Any]]
                        ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """`load` of a step fetched for the only rank on this node into memory files
        (training/ckpt/memory.py), the model file mapped shared: its tensors are the
        received pages. None where the step goes to disk instead."""
        assert self.remote is not None
        try:
            with memory_files(self.remote, step, files, self.topo.rank) as paths:
                return None if paths is None else self.read_memory(step, paths)
        except OSError as exc:  # no /proc/self/fd to open them by, after all
            log.info("rank %d: memory file unreadable (%s); fetching %s to disk", self.topo.rank, exc, step_dir(step))
            return None

    def read_memory(self, step: int, paths: dict[str, Path], how: str = ""
                    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """`load`'s result from the memory files of `step` (name -> a path that opens one), the
        model file mapped shared: its tensors are the received pages. `how`: who fetched them."""
        assert self.remote is not None
        model = unpickle(paths[MODEL_FILE], MODEL_FILE, mapped=mmap.MAP_SHARED)
        rng_file = rng_name(self.topo.rank)
        rng = unpickle(paths[rng_file], rng_file) if rng_file in paths else None
        log.info("rank %d fetched %s from %s (into memory%s: the only rank on this node)", self.topo.rank,
                 step_dir(step), self.remote.url, how)
        return model, rng

    def remote_files(self, step: int) -> dict[str, dict[str, Any]]:
        """The files this rank loads of the bucket's `step`, with their manifest entries."""
        return self._needed(self._remote_manifests(step))[0]

    def _remote_manifests(self, step: int) -> list[dict[str, Any]]:
        assert self.remote is not None
        try:
            first = check_manifest(json.loads(self.remote.fs.cat(self.remote.join(step_dir(step), manifest_name(0)))),
                                   step, f"{self.remote.url}/{step_dir(step)}/{manifest_name(0)}")
            return [first] + [check_manifest(json.loads(self.remote.fs.cat(self.remote.join(step_dir(step),
                                                                                           manifest_name(n)))),
                                             step, f"{self.remote.url}/{step_dir(step)}/{manifest_name(n)}")
                              for n in range(1, int(first["nnodes"]))]
        except CheckpointError:
            raise
        except (FileNotFoundError, ValueError) as exc:  # a manifest missing or not JSON: the step is not whole
            raise CheckpointError(f"its manifests cannot be read from {self.remote.url}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (botocore / aiohttp errors are not all OSError)
            raise self._io_fault(exc, "its manifests cannot be read") from None

    def _io_fault(self, exc: Exception, what: str) -> StorageRefused | StorageUnavailable:
        """The bucket's answer that is no fault of the step: refused for good, or unavailable now."""
        assert self.remote is not None
        cause = permanent_cause(exc)
        if cause is not None:
            return StorageRefused(f"{self.remote.url}: {cause}")
        return StorageUnavailable(f"{what} from {self.remote.url}: {type(exc).__name__}: {exc}")

    def _download(self, step: int, folder: Path, files: dict[str, dict[str, Any]]) -> None:
        """Fetch the files that are missing or bad here; one rank of the node at a time (a lock
        file), each file replaced atomically, so ranks reading it meanwhile keep a whole file."""
        assert self.remote is not None
        bad = [name for name in files if not plain_path(name)]
        if bad or folder.is_symlink():
            raise CheckpointError(f"{bad[0]!r} is not a plain file name inside the step's folder" if bad else
                                  f"{folder} is a symbolic link: not written through")
        folder.mkdir(parents=True, exist_ok=True)
        with (folder.parent / f".{step_dir(step)}.fetch").open("a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for name, meta in files.items():
                target = inside(folder, name)  # a symbolic link on disk (say a linked subfolder) is refused
                try:
                    verify(folder, {name: meta})
                    continue  # another rank fetched it already
                except CheckpointError:
                    pass
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)  # a subfolder of the step (FSDP's DCP folders)
                except OSError as exc:
                    raise CheckpointError(f"{folder.name}/{name}: its folder cannot be made: {exc}") from None
                target = inside(folder, name)  # and still none after creating the subfolders
                part = target.with_name(f"{target.name}.{self.topo.rank}.download")
                url = self.remote.url

                def fault(why: str, name: str = name) -> CheckpointError:
                    return CheckpointError(f"{name} in {url} {why}")
                try:  # one pass: hashed as it arrives (training/ckpt/fetch.py), never read back; again on a drop
                    fetch_retrying(self.remote.fs, self.remote.join(step_dir(step), name), part, meta, fault)
                except CheckpointError:
                    raise
                except FileNotFoundError as exc:
                    raise CheckpointError(f"{name} cannot be fetched from {self.remote.url}: {exc}") from None
                except Exception as exc:  # noqa: BLE001 (retried in fetch_retrying already)
                    raise self._io_fault(exc, f"{name} cannot be fetched") from None
                os.replace(part, target)
            for n, manifest in enumerate(self._remote_manifests(step)):
                path = folder / manifest_name(n)
                if not path.exists():
                    path.write_text(json.dumps(manifest, indent=1))
        log.info("rank %d fetched %s from %s", self.topo.rank, step_dir(step), self.remote.url)


class DiskTier:
    """This node's disk as a tier (training/ckpt/tiers.py): its committed steps, each file checked."""

    name = "disk"

    def __init__(self, loader: Loader):
        self.loader = loader

    def steps(self) -> set[int]:
        return set(self.loader.local_steps())

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self.loader.load_local(step)


class BucketTier:
    """The run's bucket as a tier (training/ckpt/tiers.py): steps whose every node's manifest is in."""

    name = "bucket"

    def __init__(self, loader: Loader):
        self.loader = loader

    def steps(self) -> set[int]:
        return set(self.loader.remote_steps())

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        self.loader.wait_commit()  # never a download into a step folder the writer is about to rename
        return self.loader.load_remote(step)
