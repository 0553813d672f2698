"""The newest step fetched from the bucket in a process of its own (issue 44: the library's resume
at read speed), for a rank that resumes into memory (training/ckpt/memory.py: the only rank on
its node, from an s3:// oss:// or cosn:// bucket).

Why a process. The fetch takes CPU: the store's answer received, hashed (BLAKE3) and copied into
the memory file, about 0.8 s of CPU per GB here. On a thread of the training process it shares the
interpreter's lock with what the caller does meanwhile, all of it Python that holds that lock:
importing torch, building the model and the optimizer. In a process of its own it runs on another
core beside them, and it never imports torch, so it can start before the caller does (`prefetch`).
Measured on the bench's two cores (docs/goodput-and-bench.md, "The fetch in a process of its
own").

How. `FetchProcess` makes a socket pair and starts `python -P -m training.ckpt.fetcher` (its
code; in the library's folder, in a session of its own) with one end; the request (the URL and this rank's place in the run) goes over it as one JSON line. The
process lists the bucket's complete steps, checks the newest one's manifests and fetches this
rank's files of it into memory files, each checked against its manifest as it arrives (the same
code as the in-process fetch: training/ckpt/loader.py's Loader, memory.py, fetch.py), answers
with one JSON message carrying the memory files' descriptors (SCM_RIGHTS) and exits. The training
process maps the model file from the descriptor it received: the tensors are the pages the fetch
process wrote, shared, with no copy. For global rank 0 the process first takes the bucket's run
lease for the training process and says so in one line before its answer; it answers with its
listing too, so that the training process opens its store only after its first step (`prefetch`).

What it trusts. The process is this program, started from this interpreter with this
environment, over a socket pair no other process can reach; its answer is still checked for shape
(as many descriptors as files named, each a plain file name, each file of its manifest's size).
It is used only while the settings that decide which store it read, as whom and for which run
(fetch_place.py `SETTINGS`) are what they were when it started; the manifests it checked the files against are
then the ones this process would read (for global rank 0 it read them holding the run's lease).
Any fault (the process cannot start, dies, answers nothing or a fault, or the step is too big for
memory) leaves the prefetch to the in-process path (Loader.prefetch), or to the resume itself,
which meets the same fault again and reports it as usual: nothing is logged twice and nothing is
used that the in-process path would refuse. The process ends with the training process: a thread
of it exits the process when the other end of the socket closes (the training process dropped the
fetch, or ended) or its parent is no longer the training process (it ended while a process it
forked holds that end)."""

from __future__ import annotations

import array
import atexit
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.ckpt.fetch_place import env_topology as env_topology, leases, settings  # (env_topology: also this module's)
from training.ckpt.fetch_place import key as _key

log = logging.getLogger("gts.checkpoint")

MAX_ANSWER = 1 << 20  # bytes of one answer or request: a step number and a few manifest entries
MAX_LINE = 1 << 16  # bytes of the lease line (a run id is the user's, and JSON escapes what is not ASCII)
MAX_FILES = 8  # descriptors of one answer: the model file and this rank's RNG file
ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds the training package
TOPOLOGY = ("rank", "local_rank", "world_size", "node", "nnodes", "local_world_size")  # files.Topology's fields
_FD = array.array("i")  # a descriptor's C int
# In the library's folder (cwd=ROOT), and with -P where Python has it (3.11+): the caller's working
# directory is never on the path (a `training/` there, or anyone's file in a shared folder, is never
# what runs). A session of its own: a Ctrl-C is the caller's.
FETCHER = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "training.ckpt.fetcher"]
GIVE_BACK_S = 120.0  # at most, for a lease given back (the store's own timeouts come first)
WATCH_S = 1.0  # how often a wait for the answer (here) or for the caller (the process) looks at the other side


@dataclass(frozen=True)
class Fetched:
    """What the fetch process answered: the step, its files (name -> /proc/self/fd/N of a memory
    file this process holds until FetchProcess.close) and their manifest entries as the process
    read them; or no files and the reason."""

    step: int | None
    paths: dict[str, Path]
    why: str = ""  # no files: why not
    fault: bool = False  # no files because a fault was found in the step (the resume meets it again)
    entries: dict[str, Any] = field(default_factory=dict)  # name -> the manifest entry the bytes were checked against
    listing: dict[str, Any] = field(default_factory=dict)  # the bucket's steps as it listed them (Loader.remote_steps)


class FetchProcess:
    """One fetch process and this process's end of its socket. `answer` waits for what it
    fetched; `stop` (any thread) kills it; `close` (the thread that took the answer) also reaps
    it and closes the socket and the memory files' descriptors (a mapping made meanwhile keeps
    its pages)."""

    def __init__(self, url: str, topology: Mapping[str, int], lease: bool = False):
        self.url, self.topology = url, {key: int(topology[key]) for key in TOPOLOGY}
        self.settings = settings(url)
        self.leasing = lease  # asked to take the run's lease for this process first (`lease_line`)
        self.lease_used = False  # the manager took it over (else `drop` gives it back)
        self.owner = os.getpid()  # (a process forked from this one gives nothing back)
        self._lease: dict[str, Any] | None = None
        ours, theirs = socket.socketpair()
        try:
            path = os.environ.get("PYTHONPATH", "")
            # As it started (a lease it took is given back with these settings: `_give_back`).
            self.env = {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}
            self.proc = subprocess.Popen([*FETCHER, str(theirs.fileno()), str(os.getpid())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._fds: list[int] = []
        self._fetched: Fetched | None = None
        self._reap = threading.Lock()  # a kill never races the reaping of the process (its PID freed)
        try:
            ours.sendall(json.dumps({"url": url, "topology": self.topology, "lease": lease}).encode() + b"\n")
        except OSError:  # it died at once: answer() says so
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lease_line(self) -> dict[str, Any]:
        """What the process said of the run's lease, which it takes before it lists anything when
        asked (training/ckpt/fetcher.py): {"lease": "held" | "refused" | "unknown", "run": the run
        identity, "why": ...}; {} when it was not asked or said nothing (it died, or failed
        before: then its answer is taken as lost)."""
        if self._lease is None:
            line, self._lease = b"", {}
            while self.leasing and self._fetched is None and self._answered():
                try:
                    byte = self._sock.recv(1)  # one byte at a time: nothing of the answer after the line is read
                except OSError:  # it died (killed): as an end
                    byte = b""
                if not byte:
                    break
                line += byte
                if byte == b"\n" or len(line) > MAX_LINE:
                    break
            try:
                said = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                said = None
            if isinstance(said, dict) and (said.get("lease") in ("refused", "unknown") or said.get("lease") == "held"
                                           and isinstance(said.get("token"), str) and isinstance(said.get("run"), str)):
                self._lease = said
            elif line:  # not a lease line: what came was (part of) the answer, now unreadable
                self._fetched = Fetched(None, {}, "no lease line before its answer")
        return self._lease

    def answer(self) -> Fetched:
        """What the process fetched, once it answers or ends (blocks until then)."""
        if self.leasing:
            self.lease_line()  # (read first: it comes before the answer)
        if self._fetched is None:
            try:
                reply, self._fds = _receive(self._sock) if self._answered() else ({}, [])
            except ConnectionError:  # it died with the request unread: the end of its socket
                reply = {}
            except (OSError, ValueError) as exc:
                reply = {"lost": f"its answer is unreadable ({exc})"}
            self._fetched = self._check(reply)
        return self._fetched

    def _answered(self) -> bool:
        """Until the socket has the answer (or its end), or the process has ended without it (a
        process forked here meanwhile may hold the other end of the socket open)."""
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        while not poller.poll(int(WATCH_S * 1000)):
            if self.proc.poll() is not None:
                return bool(poller.poll(0))
        return True

    def _check(self, reply: Any) -> Fetched:
        if not isinstance(reply, dict) or not reply:
            with self._reap:
                code = self.proc.wait()
            return Fetched(None, {}, f"the fetch process ended without an answer (exit status {code})")
        if "fault" in reply:
            return Fetched(None, {}, str(reply["fault"]), fault=True)
        if "lost" in reply or not isinstance(reply.get("step"), int):
            return Fetched(None, {}, str(reply.get("lost") or reply.get("why") or "no step in the bucket"))
        files = reply.get("files")
        if not isinstance(files, dict):
            return Fetched(reply["step"], {}, str(reply.get("why") or "the step goes to disk"))
        from training.ckpt.files import plain_path

        if len(files) != len(self._fds) or not all(plain_path(name) for name in files):
            return Fetched(None, {}, f"{len(self._fds)} descriptors for the files {sorted(files)}")
        for (name, meta), fd in zip(files.items(), self._fds):
            size = os.fstat(fd).st_size
            if not isinstance(meta, dict) or size != meta.get("size"):
                return Fetched(None, {}, f"{name} has {size} bytes, its manifest entry is {meta!r}")
        listing = reply.get("listing")
        if not (isinstance(listing, dict) and isinstance(listing.get("steps"), list) and reply["step"] in listing["steps"]
                and all(isinstance(step, int) for step in listing["steps"]) and isinstance(listing.get("error"), str)
                and isinstance(listing.get("told"), list) and all(isinstance(line, str) for line in listing["told"])):
            listing = {}  # (the training process lists the bucket itself)
        return Fetched(reply["step"], {name: Path(f"/proc/self/fd/{fd}") for name, fd in zip(files, self._fds)},
                       entries=files, listing=listing)

    def stop(self) -> None:
        """Kill the process if it still runs (safe from any thread: the one waiting in `answer`
        then gets the end of the socket)."""
        with self._reap:
            self._kill()

    def _kill(self) -> None:
        """(Under `_reap`.) SIGKILL unless it has ended and been reaped: its PID is never another's."""
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass

    def close(self) -> None:
        with self._reap:
            self._kill()
            self.proc.wait()
        self._sock.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._fetched = Fetched(None, {}, "closed")  # its paths named descriptors that are closed now


def _receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """The answer (JSON, {} when the process ended without one) and the descriptors that came with
    it, received close-on-exec (as the in-process fetch makes its memory files: nothing this
    process runs meanwhile inherits them)."""
    data, ancillary, flags, _ = sock.recvmsg(MAX_ANSWER, socket.CMSG_SPACE(MAX_FILES * _FD.itemsize),
                                             socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    try:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if flags & socket.MSG_CTRUNC:
            raise ValueError(f"more than {MAX_FILES} descriptors")
        chunks, size = [data], len(data)
        while data:
            data = sock.recv(1 << 16)
            chunks.append(data)
            size += len(data)
            if size > MAX_ANSWER:
                raise ValueError(f"longer than {MAX_ANSWER} bytes")
        return (json.loads(b"".join(chunks)) if size else {}), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


_EARLY: dict[str, FetchProcess] = {}  # prefetch's, by URL, until a Loader takes it
_EARLY_LOCK = threading.Lock()
_AT_EXIT = False  # drop registered to run at exit


def prefetch(url: str | None = None) -> bool:
    """Start fetching the newest checkpoint of `url` (default: the trainer contract's
    CHECKPOINT_URL) in a process of its own, now. Call it first thing, before importing torch:
    the Checkpointer made later for the same URL takes what it fetched (docs/trainer-and-library.md).
    Returns whether a fetch process started: not for a rank that shares its node with others (they
    fetch to disk, where they share one copy) or under a launcher other than torchrun's
    environment, not for a file:// URL or a path (a local read needs no process), nor where a
    process or a memory file cannot be had (the Checkpointer then fetches on a thread, as without
    this call).

    For global rank 0 the process first takes the bucket's run lease for this process (its PID
    in the holder), before it lists anything: a second run started by mistake is refused when
    its Checkpointer is made, naming the holder, as without this call, and fetches nothing; the
    manager then holds the lease and renews it (training/ckpt/lease.py). A lease taken for a URL
    no Checkpointer uses is given back when the fetch is dropped; one taken by a process that
    then dies before making its Checkpointer expires as a killed run's does. The node's run lock
    is the manager's, taken when it is made; ranks on other nodes fetch before rank 0 is refused
    (they write nothing)."""
    url = _key(url or os.environ.get("CHECKPOINT_URL", ""))
    process = sys.modules.get("multiprocessing.process")
    if process is not None and getattr(process.current_process(), "_inheriting", False):
        return False  # a spawn or forkserver child importing the caller's script again: not a resume
    topology = env_topology()
    if (url.split("://", 1)[0] not in ("s3", "oss", "cosn") or "://" not in url or topology is None
            or topology["local_world_size"] != 1 or not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd")):
        # (memory.in_memory's system checks, without importing memory.py: it imports the store's libraries)
        return False
    with _EARLY_LOCK:
        if url in _EARLY:
            return True
        try:
            _EARLY[url] = FetchProcess(url, topology, lease=leases(topology))
            global _AT_EXIT
            if not _AT_EXIT:
                _AT_EXIT = bool(atexit.register(drop))  # a start that fails before its Checkpointer gives the lease back
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            log.debug("prefetch: no fetch process (%s)", exc)
            return False
    return True


def early(url: str) -> bool:
    """Whether `prefetch` started a fetch for `url` that no Loader has taken yet."""
    with _EARLY_LOCK:
        return _key(url) in _EARLY


def drop(url: str | None = None) -> None:
    """Stop `prefetch`'s fetch for `url` (every one when None) that no Loader took: what it
    fetched is not held for the run, and a lease it took for this process is given back."""
    with _EARLY_LOCK:
        dropped = [_EARLY.pop(key) for key in list(_EARLY) if url is None or key == _key(url)]
    for fetcher in dropped:
        if fetcher.owner != os.getpid():
            continue  # a process forked from the one that started it (at its exit): the fetch is not its own
        _end(fetcher)


def _end(fetcher: FetchProcess) -> None:
    """A fetch nobody takes: its lease given back, then closed."""
    try:
        _give_back(fetcher)
    finally:
        fetcher.close()


def _give_back(fetcher: FetchProcess) -> None:
    """Stop `fetcher` and delete the lease it said it took for this process, unless the manager
    took it over: only while it is that very taking (its token: not one this process or another
    of the run took since), by a process of its own with the settings the fetch started with
    (this one imports no store library for it, also at exit). One taken but not yet said expires."""
    said = fetcher.lease_line() if fetcher.leasing and not fetcher.lease_used and fetcher.owner == os.getpid() else {}
    fetcher.stop()  # (after its line: the lease it is taking now is said, not left behind)
    if said.get("lease") != "held" or said.get("shared"):
        return  # (shared: another live process of the run held it; it renews it as its own)
    request = {"url": fetcher.url, "run": said.get("run"), "token": said.get("token"), "pid": os.getpid()}
    try:
        done = subprocess.run([*FETCHER, "give-back"], input=json.dumps(request), env=fetcher.env, cwd=ROOT, text=True,
                              capture_output=True, timeout=GIVE_BACK_S)
        why = "" if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError) as exc:
        why = str(exc)
    if why:
        log.warning("could not give back the run lease the fetch process took on %s (%s): it expires by itself",
                    fetcher.url, why)


def lease_answer(url: str) -> dict[str, Any] | None:
    """For the manager of global rank 0: what `prefetch`'s fetch process for `url` said of the
    run's lease it took for this process (FetchProcess.lease_line; the manager then holds it,
    training/ckpt/lease.py `take`), or None: no such process, not asked, or it met an outage. A
    process started with other settings is dropped first (its lease given back): the manager
    takes the lease itself."""
    with _EARLY_LOCK:
        mine = _EARLY.get(_key(url))
        changed = mine is not None and mine.settings != settings(url)
        if changed:
            del _EARLY[_key(url)]
    if mine is None:
        return None
    if changed:
        _end(mine)
        return None
    said = mine.lease_line() if mine.leasing else {}
    if said.get("lease") != "held":
        return None
    mine.lease_used = True  # the manager holds it from here on
    return said


def take(url: str, topology: Mapping[str, int]) -> FetchProcess | None:
    """The fetch process for `url` and this rank: `prefetch`'s if it started one for the same
    URL and place in the run with the same settings, else a new one; None where none can be
    started. Every other fetch `prefetch` started is stopped (made for another URL, place or
    settings, it fetched nothing this run uses)."""
    wanted = {key: int(topology[key]) for key in TOPOLOGY}
    with _EARLY_LOCK:
        mine = _EARLY.pop(_key(url), None)
    drop()
    if mine is not None and mine.topology == wanted and mine.settings == settings(url):
        return mine
    if mine is not None:
        _end(mine)
    try:
        return FetchProcess(url, wanted)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        log.debug("prefetch: no fetch process (%s); fetching on a thread", exc)
        return None
