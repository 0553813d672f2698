"""The worker command torchrun starts when the node keeps a warm start (training/node/warm.py):
`warm-python -u -m MODULE ARGS...` (or `-u SCRIPT ARGS...`), which runs
`$GTS_WARM_PYTHON -I -S warm_client.py ...`; the warm process's socket is GTS_WARM_SOCKET (an
abstract name, or a path starting with /).

Run with the standard library alone (no site, no torch): it asks the node's warm process to fork
a worker that already holds torch, handing over this process's environment, working folder and
standard streams, then stands in for that worker towards torchrun: a signal torchrun or the
entrypoint sends here (TERM, INT, HUP, QUIT, USR1, USR2) goes on to the worker's process group,
and this process ends as the worker ended (its exit code, or the same signal). If this process is
SIGKILLed (torchrun's last resort), the worker sees its connection close and kills its own group.

Whatever keeps the warm start from serving this worker (no warm process, one that refuses: a
load-time setting differs, the CUDA driver was loaded before a fork; arguments it does not
take) makes this process become the plain command instead (`exec PYTHON ARGS...`): a warm start
can make a worker start sooner, never keep it from starting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from typing import NoReturn

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
WAIT_READY_S = float(os.environ.get("GTS_WARM_WAIT_S", "120"))  # the warm process may still be importing torch
HEADER = struct.Struct("!I")


def _cold(python: str, args: list[str], why: str) -> NoReturn:
    if why:
        print(f"gts.warm: this worker starts cold: {why}", file=sys.stderr, flush=True)
    os.execv(python, [python, *args])


def _lines(sock: socket.socket):  # type: ignore[no-untyped-def]
    """The warm process's replies, one JSON object per line; ends when it closes."""
    buffered = b""
    while True:
        while b"\n" not in buffered:
            try:
                chunk = sock.recv(4096)
            except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
                continue
            if not chunk:
                return
            buffered += chunk
        line, buffered = buffered.split(b"\n", 1)
        yield json.loads(line)


def main(args: list[str]) -> None:
    python = sys.executable  # the interpreter warm-python runs this with: the workers' own
    sock_path = os.environ.get("GTS_WARM_SOCKET", "")
    if not sock_path:
        _cold(python, args, "GTS_WARM_SOCKET is not set")
    if not sock_path.startswith("/"):
        sock_path = "\0" + sock_path  # an abstract socket (training/node/warm.py start)
    if args[:1] != ["-u"] or len(args) < 2 or (args[1] == "-m" and len(args) < 3) or \
            (args[1].startswith("-") and args[1] != "-m"):
        _cold(python, args, f"arguments {args[:2]} are not `-u -m MODULE` or `-u SCRIPT`")
    pending: list[int] = []
    child: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child:
            try:
                os.killpg(child[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(WAIT_READY_S)
        sock.connect(sock_path)
        request = json.dumps({"args": args[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [HEADER.pack(len(request))], [0, 1, 2])
        sock.sendall(request)
        replies = _lines(sock)
        first = next(replies, None)
    except (OSError, ValueError) as exc:  # no warm process, or it broke off: the plain command
        first = {"cold": f"the warm process did not answer ({exc})"}
    if first is None or "pid" not in first:
        sock.close()
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        if pending:  # asked to stop before it started: stop as the plain command would have
            os.kill(os.getpid(), pending[0])
        _cold(python, args, (first or {}).get("cold", "the warm process closed without an answer"))
    child.append(int(first["pid"]))
    for signum in pending:
        forward(signum, None)
    sock.settimeout(None)
    end = next(replies, None)
    if end is None:  # the warm process is gone: the worker's end is unknown, so it is stopped
        try:
            os.killpg(child[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        print("gts.warm: the warm process went away while the worker ran; the worker was stopped",
              file=sys.stderr, flush=True)
        os._exit(1)
    if "signal" in end:
        if end["signal"] not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(int(end["signal"]), signal.SIG_DFL)
        os.kill(os.getpid(), int(end["signal"]))
        os._exit(128 + int(end["signal"]))
    os._exit(int(end["exit"]))


if __name__ == "__main__":
    main(sys.argv[1:])
