"""Warm worker starts (issue 46): every time torchrun starts a worker (the run's first start, and
every restart after a lost node, a spare joining, a condemned GPU) a fresh Python imports torch
and what the first model build and optimizer step pull in (torch._dynamo, sympy): about 3.5 s of
one core before the worker can even rendezvous, on every node at once, on the recovery path.
This process does that once per node, ahead of need, and forks each worker from it.

    python -u -m training.node.warm --socket /tmp/gts-warm-XXXX/warm.sock

`training/node/rdzv_launch.py` starts it beside the torchrun agent (so every worker stays below
the launcher, as the hang watchdog requires) and has torchrun start workers through
`warm_client.py` (torchrun's PYTHON_EXEC): the client hands over its environment, working folder
and standard streams on a Unix socket (a 0700 folder; the peer's uid is checked), and this
process forks a child that takes them over and runs `-m MODULE` or `SCRIPT` as `python -u` would,
in a process group of its own.

What the child inherits from a fork and a fresh worker would not have, and what is done about it:
- Anything read when the interpreter or a native library loads (PYTHON*, LD_*, TORCH*, the
  OpenMP/MKL/BLAS settings): a worker whose value differs from this process's is answered
  "cold" and starts as the plain command. OMP_NUM_THREADS, which torchrun sets per worker, is
  applied instead (torch.set_num_threads). torchrun's per-worker TORCHELASTIC_* and TORCH_NCCL_*
  are read at run time.
- The CUDA driver does not survive a fork: if preloading loaded it (libcuda in this process's
  maps, or torch's CUDA state initialised), every worker starts cold and this says why once.
- Random state: Python's `random` reseeds itself in a forked child; numpy's global generator is
  reseeded here from the OS, as a fresh import would; torch's default seed is a constant anyway.
  Python's hash seed is this process's (the order of a set of strings may repeat across workers).
- Only third-party modules are preloaded (GTS_WARM_PRELOAD): the run's own code is imported by
  each child, so a worker never runs code older than the files (and no module of ours reads its
  settings before the worker's environment is in place).

This process ignores the signals meant for workers (the entrypoint signals the launcher's
children, training/node/entrypoint.sh skips this one by its name), dies with the launcher
(PR_SET_PDEATHSIG), and holds no thread, so a fork copies nothing half-done.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import json
import os
import random
import runpy
import selectors
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from training.interpreter import finish

SOCKET_VAR = "GTS_WARM_SOCKET"  # the abstract socket's name, for warm_client.py
NAME = b"gts-warm"  # its process name (/proc/PID/comm), which the entrypoint's worker list skips
PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed", "torch.distributed.checkpoint",
           "torch.utils.data", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "numpy")
LOAD_TIME_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
                      "MALLOC_", "CUBLAS_", "CUDNN_")
RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS", "PYTHON_EXEC")  # torchrun's, per worker or its own
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
HEADER = struct.Struct("!I")
REQUEST_S = float(os.environ.get("GTS_WARM_REQUEST_S", "10"))  # the longest a client may take to send its request
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1


def load_time(env: dict[str, str]) -> dict[str, str]:
    """The variables a process reads as it loads, which a fork cannot change afterwards."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES) and not k.startswith(RUN_TIME)}


def differs(mine: dict[str, str], theirs: dict[str, str]) -> str:
    """Why a worker with environment `theirs` cannot be forked from a process loaded with `mine`."""
    ours, wanted = load_time(mine), load_time(theirs)
    names = sorted(k for k in ours.keys() | wanted.keys() if ours.get(k) != wanted.get(k))
    if names:
        return f"{', '.join(names[:5])} differ{'s' if len(names) == 1 else ''} from the warm process's"
    if "OMP_NUM_THREADS" in mine and "OMP_NUM_THREADS" not in theirs:
        return "OMP_NUM_THREADS is set for the warm process and not for the worker"
    return ""


def cuda_loaded(maps: str = "/proc/self/maps") -> str:
    """Why a fork would break CUDA in the children, or ''."""
    try:
        text = Path(maps).read_text()
    except OSError:
        text = ""
    if "libcuda.so" in text:
        return "the CUDA driver was loaded while preloading (a forked worker could not use it)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch's CUDA state was initialised while preloading"
    return ""


def _prctl(option: int, value: int | bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name and the parent's death watch are extras
        pass


class Warm:
    """The listening socket, the preloaded interpreter, and each child's connection until it ends."""

    def __init__(self, listener: socket.socket, preload: tuple[str, ...]) -> None:
        self.listener = listener  # listening already: workers started while torch loads wait in its backlog
        self.refusal = ""
        self.env = dict(os.environ)  # before the preload: what torch sets as it loads is not the launcher's
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a module that does not load is left to the worker
                print(f"gts.warm: {name} is not preloaded ({type(exc).__name__}: {exc})", file=sys.stderr)
        self.refusal = cuda_loaded()
        if self.refusal:
            print(f"gts.warm: every worker starts cold: {self.refusal}", file=sys.stderr)
        if threading.active_count() > 1:  # a fork would copy a thread's half-done work
            self.refusal = f"{threading.active_count() - 1} thread(s) started while preloading"
        # what the preload set for itself (torch's inductor sets TORCHINDUCTOR_CACHE_DIR), which a
        # fresh worker would have set too as it imported the same modules
        self.added = {k: v for k, v in os.environ.items() if k not in self.env}
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.conns: dict[int, socket.socket] = {}  # pidfd -> the child's client connection

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    self._accept()
                else:
                    self._reap(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_S)  # one serving loop: a client that never finishes its request must not stall it
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                raise ValueError("a client of another user")
            head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
            size = HEADER.unpack(head)[0] if len(head) == HEADER.size else 0
            payload = b""
            while len(payload) < size:
                chunk = conn.recv(size - len(payload))
                if not chunk:
                    raise ValueError("the request ended early")
                payload += chunk
            request = json.loads(payload)
            if len(fds) != 3 or not size:
                raise ValueError("a request without its three standard streams")
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            print(f"gts.warm: a request was refused ({exc})", file=sys.stderr)
            conn.close()
            return
        conn.settimeout(None)
        why = self.refusal or differs(self.env, request["env"])
        if why:
            for fd in fds:
                os.close(fd)
            self._send(conn, {"cold": why})
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(conn, fds, request)  # never returns
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.conns[pidfd] = conn
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        self._send(conn, {"pid": pid})

    def _reap(self, pidfd: int, pid: int) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)
        conn = self.conns.pop(pidfd)
        _, status = os.waitpid(pid, 0)
        end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
        self._send(conn, end)
        conn.close()

    @staticmethod
    def _send(conn: socket.socket, message: Mapping[str, object]) -> None:
        try:
            conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError:  # the client is gone; its child (if any) has seen it too
            pass

    def _child(self, conn: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
        """Become the worker: its group, streams, folder, environment and arguments; run it; exit."""
        code = 1
        try:
            os.setpgid(0, 0)
            self.selector.close()
            self.listener.close()
            for pidfd, other in self.conns.items():
                os.close(pidfd)
                other.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _prctl(PR_SET_NAME, Path(sys.executable).name.encode()[:15])
            _prctl(PR_SET_PDEATHSIG, 0)
            os.chdir(str(request["cwd"]))
            os.environ.clear()
            os.environ.update(request["env"])
            for name, value in self.added.items():
                os.environ.setdefault(name, value)
            _settle()
            threading.Thread(target=_watch, args=(conn,), name="gts-warm-watch", daemon=True).start()
            code = _run([str(a) for a in request["args"]])
        except BaseException:  # noqa: BLE001 - the child must never return into the serving loop
            traceback.print_exc()
        finish(code)  # the interpreter's exit up to its finalisation


def _settle() -> None:
    """What a fresh worker would have that the fork did not give."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    random.seed()


def _watch(conn: socket.socket) -> None:
    """The client (the process torchrun started) closing means it was killed: so is this group."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def _run(args: list[str]) -> int:
    """`python -u -m MODULE ARGS` or `python -u SCRIPT ARGS`, in this process; its exit code."""
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
        if stop.code is None or isinstance(stop.code, int):
            return int(stop.code or 0)
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught one
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def listen(path: str) -> socket.socket:
    """The warm process's socket, bound and listening: a path (0600) or an abstract name ("\\0...")."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    if not path.startswith("\0"):
        os.chmod(path, 0o600)
    listener.listen(128)
    return listener


def start(no_python: bool, env: MutableMapping[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    """For the launcher (training/node/rdzv_launch.py), before torchrun reads its settings: this
    node's warm process, listening on an abstract Unix socket (no file to leave behind when the
    launcher is killed; the peer's uid is checked), and torchrun's PYTHON_EXEC set to warm-python,
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
                "GTS_WARM_PYTHON": sys.executable})

    def stop() -> None:
        proc.kill()
        proc.wait()

    atexit.register(stop)
    return proc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="the Unix socket to listen on (its folder should be 0700)")
    where.add_argument("--fd", type=int, help="a listening Unix socket it inherits (the launcher's, training.node.warm.start)")
    parser.add_argument("--parent", type=int, default=0, help="exit if this process (the launcher) is gone")
    args = parser.parse_args(argv)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if args.parent and os.getppid() != args.parent:  # it died before the death signal was asked for
        return
    _prctl(PR_SET_NAME, NAME)
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    preload = tuple(os.environ.get("GTS_WARM_PRELOAD", " ".join(PRELOAD)).split())
    listener = listen(args.socket) if args.socket else socket.socket(fileno=args.fd)
    Warm(listener, preload).serve()


if __name__ == "__main__":
    from training.node import warm as _self  # run from the module, so a child's __main__ is the worker's own

    _self.main()
