"""The fetch process's own code (`python -P -m training.ckpt.fetcher`, started by
training/ckpt/fetch_process.py, whose docstring says why and how): it reads the request, lists,
checks and fetches as the in-process prefetch would, answers with the memory files' descriptors
and exits. It never imports torch, and it exits when the training process closes its end of the
socket (it dropped the fetch, or ended) or is no longer its parent."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from training.ckpt.fetch_process import MAX_ANSWER, TOPOLOGY, WATCH_S


def _request(sock: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        more = sock.recv(1 << 16)
        if not more or len(data) + len(more) > MAX_ANSWER:
            raise ValueError("no whole request")
        data += more
    request = json.loads(data)
    if not isinstance(request, dict) or not isinstance(request.get("url"), str):
        raise ValueError("not a request")
    return request


def _send(sock: socket.socket, reply: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(reply).encode()
    sent = socket.send_fds(sock, [data], fds)
    sock.sendall(data[sent:])
    sock.shutdown(socket.SHUT_WR)


def _exit_with_caller(sock: socket.socket, caller: int) -> None:
    """Until the training process closes its end of the socket (it dropped the fetch, or ended)
    or is no longer this process's parent (it ended while a process it forked meanwhile, a
    DataLoader worker, still holds that end): then exit."""
    try:
        poller = select.poll()  # (select.select refuses a descriptor numbered 1024 or more)
        poller.register(sock, select.POLLIN)
        while os.getppid() == caller:
            if poller.poll(int(WATCH_S * 1000)) and not sock.recv(1 << 12):
                return
    finally:
        os._exit(0)


def _lease(sock: socket.socket, remote: Any, caller: int) -> bool:
    """Take the run's lease for the training process (its PID in the holder) and say so in one
    line (FetchProcess.lease_line): held, refused (naming the holder: nothing is fetched), or
    unknown (the store did not answer: the training process takes it itself)."""
    from training.ckpt.lease import Lease, LeaseHeld, run_identity

    lease = Lease(remote, run_identity(os.environ, caller), pid=caller)
    said: dict[str, Any] = {"lease": "held", "run": lease.run}
    try:
        lease.acquire()
        said.update(token=lease.token, expires=lease.expires, shared=lease.shared)
    except LeaseHeld as exc:
        said.update(lease="refused", why=str(exc)[:1000])
    except Exception as exc:  # noqa: BLE001 (an outage: the training process meets it itself)
        said.update(lease="unknown", why=f"{type(exc).__name__}: {exc}"[:1000])
    sock.sendall(json.dumps(said).encode() + b"\n")  # (over MAX_LINE, a run id that long: the training process takes it)
    return bool(said["lease"] != "refused")


def _fetch(sock: socket.socket, request: dict[str, Any], caller: int) -> None:
    """Take the lease when asked, then list, check and fetch as the in-process prefetch would
    (Loader.remote_steps, the step's manifests, memory_files), and answer with the listing too."""
    from training.ckpt.files import Topology
    from training.ckpt.loader import Loader
    from training.ckpt.memory import memory_files
    from training.ckpt.storage import location

    topo = Topology(**{key: int(request["topology"][key]) for key in TOPOLOGY})
    remote = location(request["url"])
    if request.get("lease") is True and not _lease(sock, remote, caller):
        _send(sock, {"step": None, "why": "the lease is another run's"}, [])
        return
    loader = Loader(Path(os.devnull), remote, topo, False, lambda: None)  # its bucket only: no local folder
    steps = loader.remote_steps()
    if not steps:
        _send(sock, {"step": None, "why": loader.remote_error or "no step in the bucket"}, [])
        return
    step = steps[-1]
    files = loader.remote_files(step)
    with memory_files(remote, step, files, topo.rank) as paths:
        if paths is None:
            _send(sock, {"step": step, "why": "the step goes to disk (too big for memory, or no memory files)"}, [])
            return
        listing = {"steps": steps, "error": loader.remote_error, "told": loader.told}
        _send(sock, {"step": step, "files": files, "listing": listing}, [int(path.name) for path in paths.values()])


def _give_back(request: dict[str, Any]) -> int:
    """`give-back` (fetch_process.py `_give_back`): delete the lease taken for process `pid` as
    that very taking (`token`), if it still is. Exit status 1 with the reason when it could not."""
    from training.ckpt.lease import Lease
    from training.ckpt.storage import location

    store = Lease(location(str(request["url"])), str(request["run"]), pid=int(request["pid"])).store
    current = store.read()
    if current is not None and current[0].get("token") == str(request["token"]):
        store.delete()
    return 0


def main(argv: list[str]) -> int:
    logging.disable(logging.CRITICAL)  # the training process repeats each check that matters and says what it finds
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the training process's to handle; this one ends with it
    if argv[:1] == ["give-back"]:
        try:
            return _give_back(json.loads(sys.stdin.read()))
        except Exception as exc:  # noqa: BLE001 (said in one line: the training process logs it)
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    try:
        sock, caller = socket.socket(fileno=int(argv[0])), int(argv[1])
    except (IndexError, ValueError, OSError):
        print("python -m training.ckpt.fetcher is started by the checkpoint library "
              "(training/ckpt/fetch_process.py), not by hand", file=sys.stderr)
        return 2
    try:
        request = _request(sock)
    except (OSError, ValueError):
        return 1
    threading.Thread(target=_exit_with_caller, args=(sock, caller), name="caller-watch", daemon=True).start()
    try:
        _fetch(sock, request, caller)
    except BaseException as exc:  # noqa: BLE001 (nothing this process meets is raised in the training process)
        _answer_fault(sock, exc)
    sys.stdout.flush()
    os._exit(0)  # no teardown of the store's client and event loop: nothing is left to write


def _answer_fault(sock: socket.socket, exc: BaseException) -> None:
    """A fault of the step or an answer of the store (the resume meets it again and reports it:
    `fault`), or anything else (an import, a setting, this system: `lost`, and the training
    process fetches on a thread instead)."""
    try:
        from training.ckpt.files import CheckpointError
        from training.ckpt.storage import StorageRefused, StorageUnavailable

        kind = "fault" if isinstance(exc, (CheckpointError, StorageRefused, StorageUnavailable)) else "lost"
    except Exception:  # noqa: BLE001 (the library itself cannot be imported here)
        kind = "lost"
    try:
        _send(sock, {kind: f"{type(exc).__name__}: {exc}"}, [])
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
