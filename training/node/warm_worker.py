"""What a worker forked by the warm process (training/node/warm.py) runs as itself: the worker's
command as `python -u` would run it, its exit code told to its client as its last exit handler,
and a watch that ends its process group when the client (the process torchrun started) is gone."""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn


def send(conn: socket.socket, message: Mapping[str, object]) -> None:
    """One message to a client, a JSON line; a client that is gone is not an error (its worker, if
    any, has been stopped)."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def watch(conn: socket.socket) -> None:
    """The client (the process torchrun started) closing means it was killed: so is this group.
    A second watch, for a warm process that is gone (the warm process's own watch comes first)."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


EXIT_CODE: list[int] = []  # the worker's exit code once known, for report


def run(args: list[str]) -> NoReturn:
    """`python -u -m MODULE ARGS` or `python -u SCRIPT ARGS`, in this process, then out as the
    interpreter leaves: SystemExit with the code, the traceback and 1 for an uncaught error, the
    KeyboardInterrupt itself (the interpreter then ends by SIGINT, as python does)."""
    try:
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(args[1])  # type: ignore[attr-defined]  # what `python -m` runs
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        EXIT_CODE.append(int(code or 0))
        raise SystemExit(int(code or 0)) from None
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught one
        sys.excepthook(*sys.exc_info())
        EXIT_CODE.append(1)
        raise SystemExit(1) from None
    EXIT_CODE.append(0)
    raise SystemExit(0)


def report(conn: socket.socket) -> None:
    """The worker's exit code to its client, as its last exit handler: the client takes the warm
    process's report of the worker's end, and this one only if the warm process is gone."""
    if EXIT_CODE:
        send(conn, {"worker_exit": EXIT_CODE[-1]})
