"""The launcher's side of warm worker starts (training/node/warm.py): the socket, the warm process
beside the torchrun agent, and torchrun's PYTHON_EXEC pointed at warm-python."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path

SOCKET_VAR = "GTS_WARM_SOCKET"  # the abstract socket's name, for warm_client.py


def listen(path: str) -> socket.socket:
    """The warm process's socket, bound and listening: a path (0600) or an abstract name ("\\0...").
    A path appears only once it listens (bound under a name of this process's in the same folder,
    then linked into place): a client that finds the file is never refused, and one that comes
    while the preload runs waits in the backlog. A path in use is refused (EADDRINUSE), as bind
    refuses it, and left alone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if path.startswith("\0"):
        listener.bind(path)
        listener.listen(128)
        return listener
    staging = os.path.join(os.path.dirname(path), f".gts-warm-{os.getpid()}")
    try:
        listener.bind(staging)
        os.chmod(staging, 0o600)
        listener.listen(128)
        try:
            os.link(staging, path)  # the same socket under its name; never over another file
        except FileExistsError:
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE), path) from None
    except BaseException:
        listener.close()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
    return listener


def start(no_python: bool, env: MutableMapping[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    """For the launcher (training/node/rdzv_launch.py), before torchrun reads its settings: this
    node's warm process, listening on an abstract Unix socket (no file to leave behind when the
    launcher is killed; the peer's uid and namespaces are checked), and torchrun's PYTHON_EXEC set to warm-python,
    which starts each worker through it; None where the workers are not `python` (--no-python),
    GTS_WARM_WORKERS=0, or the user has a PYTHON_EXEC of their own."""
    env = os.environ if env is None else env
    if no_python or env.get("GTS_WARM_WORKERS", "1") == "0" or "PYTHON_EXEC" in env:
        return None
    name = f"gts-warm-{os.getpid()}-{secrets.token_hex(8)}"
    with listen("\0" + name) as listener:  # before torchrun starts a worker: none finds no socket
        proc = subprocess.Popen([sys.executable, "-u", "-m", "training.node.warm", "--fd", str(listener.fileno()),
                                 "--parent", str(os.getpid())], env=dict(env), pass_fds=[listener.fileno()])
    env.update({"PYTHON_EXEC": str(Path(__file__).with_name("warm-python")), SOCKET_VAR: name,
                # the socket's owner as the kernel tells a client (SO_PEERCRED: who called listen)
                "GTS_WARM_PID": str(os.getpid()), "GTS_WARM_PYTHON": sys.executable})

    def stop() -> None:
        proc.kill()
        proc.wait()

    atexit.register(stop)
    return proc
