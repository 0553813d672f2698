"""The worker command torchrun starts when the node keeps a warm start (training/node/warm.py):
`warm-python -u -m MODULE ARGS...` (or `-u SCRIPT ARGS...`), which runs
`$GTS_WARM_PYTHON -I -S warm_client.py ...`; the warm process listens on GTS_WARM_SOCKET (an
abstract name, or a path starting with /), which the launcher (GTS_WARM_PID) opened.

Run with the standard library alone (no site, no torch): it asks the node's warm process to fork
a worker that already holds torch, handing over this process's environment, working folder, CPU
affinity and standard streams, then stands in for that worker towards torchrun:
- a signal (TERM, INT, HUP, QUIT, USR1, USR2) goes on to the worker as it came here: to the
  worker's process group when it came from this process's parent (torchrun signals its worker's
  whole group), to the worker alone when another process sent it to this one (the entrypoint's
  TERM and USR1 are for the worker, not its data loaders);
- this process ends as the worker ended (its exit code, or the same signal);
- if this process is SIGKILLed (torchrun's last resort), the warm process kills the worker's group.

Whatever keeps the warm start from serving this worker (no warm process, one that is not the
launcher's, one that refuses: a load-time setting differs, the CUDA driver was loaded before a
fork; arguments it does not take) makes this process become the plain command instead
(`exec PYTHON ARGS...`): a warm start can make a worker start sooner, never keep it from starting.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

FORWARDED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}
DONE = signal.SIGCHLD  # sent to this process's main thread by its reader once the worker's end is known
LAST_WORD_S = 30.0  # after the worker's own report, how long the warm process's may take (the worker's finalisation)
WAIT_READY_S = float(os.environ.get("GTS_WARM_WAIT_S", "120"))  # the warm process may still be importing torch
HEADER = struct.Struct("!I")


def _cold(args: list[str], why: str) -> NoReturn:
    """Become `python ARGS`: signals that came meanwhile are acted on first, as a plain worker would."""
    if why:
        print(f"gts.warm: this worker starts cold: {why}", file=sys.stderr, flush=True)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    pending = signal.sigpending() & FORWARDED
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED | {DONE})  # exec keeps the mask: leave it clean
    if pending:  # unblocked with the default action: this process has ended already
        os._exit(128 + min(pending))
    os.execv(sys.executable, [sys.executable, *args])


def _lines(sock: socket.socket) -> Iterator[dict[str, int | str]]:
    """The replies, one JSON object per line; ends when every holder of the other end has closed it."""
    buffered = b""
    while True:
        while b"\n" not in buffered:
            chunk = sock.recv(4096)  # a timeout or a reset is the caller's to say
            if not chunk:
                return
            buffered += chunk
        line, buffered = buffered.split(b"\n", 1)
        yield json.loads(line)


def _connect(args: list[str]) -> tuple[socket.socket, Iterator[dict[str, int | str]], int]:
    name = os.environ.get("GTS_WARM_SOCKET", "")
    if not name:
        _cold(args, "GTS_WARM_SOCKET is not set")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first: dict[str, int | str] | None
    try:
        sock.settimeout(WAIT_READY_S)
        sock.connect(name if name.startswith("/") else "\0" + name)
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        expected = os.environ.get("GTS_WARM_PID", "")
        # a squatter on the name of a warm process gone, or a socket of another pid namespace (pid 0 here)
        if uid != os.getuid() or not pid or (expected and str(pid) != expected):
            sock.close()
            _cold(args, f"the socket's owner (pid {pid}, uid {uid}) is not the launcher's warm process")
        request = json.dumps({"args": args[1:], "env": dict(os.environ), "cwd": os.getcwd(),
                              "cpus": sorted(os.sched_getaffinity(0))}).encode()
        socket.send_fds(sock, [HEADER.pack(len(request))], [0, 1, 2])
        sock.sendall(request)
        replies = _lines(sock)
        first = next(replies, None)
    except (OSError, ValueError) as exc:  # no warm process, or it broke off: the plain command
        sock.close()
        _cold(args, f"the warm process did not answer ({exc})")
    if first is None or "pid" not in first:
        sock.close()
        _cold(args, str((first or {}).get("cold", "the warm process closed without an answer")))
    sock.settimeout(None)
    return sock, replies, int(first["pid"])


def main(args: list[str]) -> NoReturn:
    # Blocked from the start and taken one by one (sigwaitinfo says who sent each): none is lost
    # between this process's start and the worker's, nor acted on twice.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED | {DONE})
    if args[:1] != ["-u"] or len(args) < 2 or (args[1] == "-m" and len(args) < 3) or \
            (args[1].startswith("-") and args[1] != "-m"):
        _cold(args, f"arguments {args[:2]} are not `-u -m MODULE` or `-u SCRIPT`")
    sock, replies, child = _connect(args)
    ends: list[dict[str, int | str]] = []
    finished = threading.Event()
    main_thread = threading.main_thread().ident

    def read() -> None:
        """Until the warm process's report of the worker's end (its last message), not the close: a
        process the worker forked and left behind holds the connection open too. The worker's own
        report comes just before; if the warm process is gone, that one is taken after a while."""
        try:
            for message in replies:
                ends.append(message)
                if "exit" in message or "signal" in message:
                    break
                if "worker_exit" in message:
                    sock.settimeout(LAST_WORD_S)
        except (OSError, ValueError):  # the wait after the worker's report ran out, or a reset
            pass
        finally:
            finished.set()
            signal.pthread_kill(main_thread, DONE)  # type: ignore[arg-type]

    threading.Thread(target=read, daemon=True).start()
    parent = os.getppid()
    while True:
        info = signal.sigwaitinfo(FORWARDED | {DONE})
        if info.si_signo == DONE:
            if finished.is_set():
                break
            continue
        try:
            (os.killpg if info.si_pid == parent else os.kill)(child, info.si_signo)
        except ProcessLookupError:
            pass
    sock.close()
    by_warm = [e for e in ends if "exit" in e or "signal" in e]
    by_worker = [e for e in ends if "worker_exit" in e]
    if by_warm and "signal" in by_warm[0]:
        sig = int(by_warm[0]["signal"])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker's core file, if any, is the one wanted
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    if by_warm:
        os._exit(int(by_warm[0]["exit"]))
    if by_worker:  # the warm process is gone; the worker said how it ended
        os._exit(int(by_worker[0]["worker_exit"]))
    print("gts.warm: the warm process went away and the worker ended without saying how (a signal, or a fast "
          "exit); counted as a failure", file=sys.stderr, flush=True)
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
