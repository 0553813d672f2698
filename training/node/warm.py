"""Warm worker starts (issue 46): every time torchrun starts a worker (the run's first start, and
every restart after a lost node, a spare joining, a condemned GPU) a fresh Python imports torch
and what the first model build and optimizer step pull in (torch._dynamo, sympy): about 3.5 s of
one core before the worker can even rendezvous, on every node at once, on the recovery path.
This process does that once per node, ahead of need, and forks each worker from it.

    python -u -m training.node.warm --socket /tmp/gts-warm.sock    # by hand; the launcher passes --fd

`training/node/rdzv_launch.py` (through warm_launch.py) starts it beside the torchrun agent (so every worker stays below
the launcher, as the hang watchdog requires) on an abstract Unix socket (nothing on disk to leave
behind when the launcher is killed) and has torchrun start workers through `warm-python`
(torchrun's PYTHON_EXEC), which runs `warm_client.py`: the client hands over its environment,
working folder, CPU affinity and standard streams, and this process forks a child that takes
them over and runs `-m MODULE` or `SCRIPT` as `python -u` would, in a process group of its own,
and leaves as that interpreter would (its finalisation included). Who may ask: a process of this
uid in this container (its mount namespace), checked before anything is read; the client checks
in turn that the socket is the one the launcher opened (GTS_WARM_PID), not a squatter's on a
name left free.

What the child inherits from a fork and a fresh worker would not have, and what is done about it:
- Anything read when the interpreter or a native library loads (PYTHON*, LD_*, TORCH*, the
  OpenMP/MKL/BLAS settings) and the CPU affinity: a worker whose value differs from this
  process's is answered "cold" and starts as the plain command. OMP_NUM_THREADS, which torchrun
  sets per worker, is applied instead (torch.set_num_threads). torchrun's per-worker
  TORCHELASTIC_* and TORCH_NCCL_* are read at run time.
- The CUDA driver does not survive a fork: if preloading loaded it (libcuda in this process's
  maps, or torch's CUDA state initialised), every worker starts cold and this says why once.
- Random state: Python's `random` and numpy's global generator are reseeded from the OS, as a
  fresh import would; torch's default seed is a constant anyway. Python's hash seed is this
  process's (the order of a set of strings may repeat across workers).
- Only third-party modules are preloaded (GTS_WARM_PRELOAD): the run's own code is imported by
  each child (bar the warm start's own modules and the guard's, which this process runs), so a
  worker never runs code older than its files.

A worker's end is known here (its pidfd) and told to its client; a client that is gone first
was killed (torchrun's last resort), and its worker's group is SIGKILLed here, whatever the
worker is doing. This process blocks the signals meant for workers (a child unblocks them once
its handlers are the worker's; started by hand, it takes Ctrl-C, TERM and HUP between requests:
main), is skipped by name by the entrypoint's worker list (training/node/entrypoint.sh), dies
with the launcher (PR_SET_PDEATHSIG), and holds no thread, so a fork copies nothing half-done."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from training.node.guard import PR_SET_NAME, PR_SET_PDEATHSIG, prctl
from training.node.warm_launch import listen
from training.node.warm_worker import report, run, send, watch
from training.node.warm_rules import Request, client_gone, cuda_loaded, differs, namespace, settle, unserved

NAME = b"gts-warm"  # its process name (/proc/PID/comm), which the entrypoint's worker list skips
PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed", "torch.distributed.checkpoint",
           "torch.utils.data", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "numpy")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
HEADER = struct.Struct("!I")
MAX_REQUEST = 16 << 20  # an environment and arguments; more is not a worker's request
REQUEST_S = float(os.environ.get("GTS_WARM_REQUEST_S", "10"))  # the longest a client may take to send its request


def _prctl(option: int, value: int | bytes) -> None:
    """The guard's prctl; here its name and the launcher's death watch are extras where it fails."""
    try:
        prctl(option, value)
    except (OSError, AttributeError):
        pass


class Warm:
    """The listening socket, the preloaded interpreter, and each child's connection until it ends."""

    def __init__(self, listener: socket.socket, preload: tuple[str, ...]) -> None:
        self.listener = listener  # listening already: workers started while torch loads wait in its backlog
        self.env = dict(os.environ)  # before the preload: what torch sets as it loads is not the launcher's
        self.cpus = sorted(os.sched_getaffinity(0))
        self.mnt, self.pidns = namespace(os.getpid()), namespace(os.getpid(), "pid")
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a module that does not load is left to the worker
                print(f"gts.warm: {name} is not preloaded ({type(exc).__name__}: {exc})", file=sys.stderr)
        self.refusal = cuda_loaded()
        if not self.refusal and threading.active_count() > 1:  # a fork would copy a thread's half-done work
            self.refusal = f"{threading.active_count() - 1} thread(s) started while preloading"
        if not self.refusal:
            try:
                os.close(os.pidfd_open(os.getpid()))  # how each child's end is awaited (Linux 5.3)
            except (OSError, AttributeError) as exc:
                self.refusal = f"this kernel has no pidfd_open ({exc})"
        if self.refusal:
            print(f"gts.warm: every worker starts cold: {self.refusal}", file=sys.stderr)
        # what the preload set for itself (torch's inductor sets TORCHINDUCTOR_CACHE_DIR), which a
        # fresh worker would have set too as it imported the same modules
        self.added = {k: v for k, v in os.environ.items() if k not in self.env}
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, ("listener", 0))
        self.conns: dict[int, tuple[socket.socket, int]] = {}  # child pid -> its client's connection, its pidfd

    def serve(self) -> None:
        while True:
            _Stop.idle = True  # a stop (started by hand) is taken here only, never inside a request
            try:
                if _Stop.asked:
                    raise _Stopped(_Stop.asked)
                ready = self.selector.select()
            finally:
                _Stop.idle = False
            for key, _ in ready:
                kind, pid = key.data
                try:
                    if kind == "listener":
                        self._accept()
                    elif kind == "ended":
                        self._reap(pid)
                    else:
                        self._client_closed(pid)
                except Exception:  # noqa: BLE001 - one request's fault must not end the node's warm start
                    print("gts.warm: a request failed:", file=sys.stderr)
                    traceback.print_exc()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            try:
                self._admit(conn)
            except (OSError, ValueError) as exc:  # not for this process: no answer at all
                print(f"gts.warm: a request was refused ({exc})", file=sys.stderr)
                conn.close()
                return
            try:
                request, fds = self._read(conn)
            except (OSError, ValueError, ValidationError) as exc:
                why = f"{exc.error_count()} error(s) in the request" if isinstance(exc, ValidationError) else str(exc)
                print(f"gts.warm: a request was refused ({why})", file=sys.stderr)
                self._send(conn, {"cold": f"the warm process refused the request ({why})"})
                conn.close()
                return
            why = self.refusal or differs(self.env, request.env) or unserved(request, self.cpus)
            if not why and client_gone(conn):  # it gave up waiting and started cold already
                conn.close()
                return
            if why:
                self._send(conn, {"cold": why})
                conn.close()
                return
            sys.stdout.flush()
            sys.stderr.flush()
            go_read, go = os.pipe()  # the child runs the worker once its client knows its pid
            # a child starts with the workers' signals blocked (it unblocks them once its handlers are
            # the worker's); this process may take some of them itself when started by hand (main)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            try:
                pid = os.fork()
            except OSError as exc:  # no process to spare (a pids limit, memory): the client starts it itself
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                os.close(go_read)
                os.close(go)
                self._send(conn, {"cold": f"the warm process could not fork ({exc})"})
                conn.close()
                return
            if pid == 0:
                os.close(go)
                try:
                    self._child(conn, fds, request, go_read)  # never returns
                except (SystemExit, KeyboardInterrupt):  # the worker's end: out through every frame above
                    raise
                except BaseException:  # noqa: BLE001 - never into the serving loop's `except Exception`
                    traceback.print_exc()
                    raise SystemExit(1) from None
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(go_read)
        finally:
            for fd in fds:
                os.close(fd)
        self._follow(pid, conn, go)

    def _follow(self, pid: int, conn: socket.socket, go: int) -> None:
        """The forked worker watched (its end, its client's) and its pid told, then let run."""
        try:
            self._started(pid, conn)
            os.write(go, b"g")
        except Exception:
            try:  # a worker nobody can wait for or signal is not left running beside the cold one
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            self.conns.pop(pid, None)
            self._send(conn, {"cold": "the warm process could not follow the worker it forked"})
            conn.close()
            raise
        finally:
            os.close(go)

    def _started(self, pid: int, conn: socket.socket) -> None:
        try:
            os.setpgid(pid, pid)  # here too, so the client's first signal finds the group (the child does it as well)
        except OSError:  # the child did it first
            pass
        pidfd = os.pidfd_open(pid)
        self.conns[pid] = (conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, ("ended", pid))
        self.selector.register(conn, selectors.EVENT_READ, ("client", pid))
        self._send(conn, {"pid": pid})

    def _admit(self, conn: socket.socket) -> None:
        """Only a process of this uid in this container (mount and pid namespaces) is answered."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise ValueError("a client of another user")
        # another container on the host's network with the same uid; a pid namespace of its own
        # (pid 0 here), where the worker's pid would name another process
        if not peer or namespace(peer) != self.mnt or namespace(peer, "pid") != self.pidns:
            raise ValueError(f"a client outside this container (pid {peer})")

    def _read(self, conn: socket.socket) -> tuple[Request, list[int]]:
        conn.settimeout(REQUEST_S)  # one serving loop: a client that never finishes its request must not stall it
        head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        try:
            size = HEADER.unpack(head)[0] if len(head) == HEADER.size else 0
            if len(fds) != 3 or not 0 < size <= MAX_REQUEST:
                raise ValueError(f"a request of {size} bytes with {len(fds)} of its three standard streams")
            payload = bytearray()
            while len(payload) < size:
                chunk = conn.recv(size - len(payload))
                if not chunk:
                    raise ValueError("the request ended early")
                payload += chunk
            # json first: an environment with undecodable bytes comes as lone surrogates, which os.environ
            # turns back into the same bytes (pydantic's own JSON parser refuses them)
            request = Request.model_validate(json.loads(bytes(payload)), strict=True)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        conn.settimeout(None)
        return request, fds

    def _client_closed(self, pid: int) -> None:
        """The client (the process torchrun started) is gone before its worker: killed, so the worker
        is too. Done here, not only by the worker's own thread, which a native call holding the GIL
        or a stopped process would keep from running."""
        if pid not in self.conns:  # its end was handled first in the same batch of events
            return
        conn, _ = self.conns[pid]
        try:
            if conn.recv(64):  # the client sends nothing after its request: anything else is ignored
                return
        except OSError:  # reset: gone all the same
            pass
        self.selector.unregister(conn)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self, pid: int) -> None:
        conn, pidfd = self.conns.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        if conn.fileno() in self.selector.get_map():
            self.selector.unregister(conn)
        _, status = os.waitpid(pid, 0)
        end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
        self._send(conn, end)
        conn.close()

    _send = staticmethod(send)

    def _child(self, conn: socket.socket, fds: list[int], request: Request, go: int) -> NoReturn:
        """Become the worker: its group, streams, folder, environment and arguments; run it; then
        leave as the interpreter would after `python -u ...`, by an exception no frame of the
        serving loop catches (SystemExit or KeyboardInterrupt), so the whole finalisation runs."""
        try:
            os.setpgid(0, 0)
            self.selector.close()
            self.listener.close()
            for other, pidfd in self.conns.values():
                os.close(pidfd)
                other.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            fds.clear()
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # what was sent meanwhile acts now, as on a bare process
            signal.signal(signal.SIGINT, signal.default_int_handler)  # then as Python sets it at its start
            _prctl(PR_SET_NAME, Path(sys.executable).name.encode()[:15])
            _prctl(PR_SET_PDEATHSIG, 0)
            os.chdir(request.cwd)
            os.environ.clear()
            os.environ.update(request.env)
            for name, value in self.added.items():
                os.environ.setdefault(name, value)
            settle()
            threading.Thread(target=watch, args=(conn,), name="gts-warm-watch", daemon=True).start()
            atexit.register(report, conn)  # first registered, so it runs last of the worker's handlers
            if os.read(go, 1) != b"g":  # its client knows its pid first: a report never comes before it
                os._exit(1)
            os.close(go)
        except BaseException:  # noqa: BLE001 - a child that could not become the worker never serves
            traceback.print_exc()
            os._exit(1)
        run(request.args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="a Unix socket path to listen on (made 0600), for a warm process started by hand")
    where.add_argument("--fd", type=int, help="a listening Unix socket it inherits (the launcher's, warm_launch.start)")
    parser.add_argument("--parent", type=int, default=0, help="exit if this process (the launcher) is gone")
    args = parser.parse_args(argv)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if args.parent and os.getppid() != args.parent:  # it died before the death signal was asked for
        return
    _prctl(PR_SET_NAME, NAME)
    # blocked, not ignored: a child unblocks them once its handlers are the worker's, and gets what was
    # sent to it meanwhile (an ignored signal would be lost)
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    preload = tuple(os.environ.get("GTS_WARM_PRELOAD", " ".join(PRELOAD)).split())
    if args.fd is not None:  # the launcher's: it ends with the launcher, whatever the terminal sends
        Warm(socket.socket(fileno=args.fd), preload).serve()
        return
    # started by hand: Ctrl-C, TERM and HUP end it (those not ignored when it started, as for nohup),
    # between requests, never inside one; its workers run on, each reporting its own exit code
    listener = listen(args.socket)  # a path in use is refused here, and left alone
    bound, warm_pid = os.stat(args.socket), os.getpid()
    try:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) != signal.SIG_IGN:
                signal.signal(sig, _stop)
        _Stop.idle = True  # preloading: no request in hand yet
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked again around each fork (_accept)
        warm = Warm(listener, preload)
        _Stop.idle = False
        warm.serve()
    except _Stopped as stop:
        _Stop.asked = stop.signum
    finally:
        if os.getpid() == warm_pid:  # a worker leaves through these frames too (its SystemExit)
            listener.close()
            with contextlib.suppress(OSError):
                now = os.stat(args.socket)
                if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):  # still ours, not a later one's
                    os.unlink(args.socket)
    print(f"gts.warm: stopped by {signal.Signals(_Stop.asked).name}", file=sys.stderr)
    signal.signal(_Stop.asked, signal.SIG_DFL)  # and ends by that signal, as a shell expects of Ctrl-C
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [_Stop.asked])
    os.kill(os.getpid(), _Stop.asked)
    raise SystemExit(128 + _Stop.asked)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stopped(BaseException):  # not an Exception: the serving loop's handler does not catch it
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Stop:
    """A stop asked by a signal: taken at once while the serving loop waits, else once the
    request in hand is done (a worker half-started, reaped or killed is never left so)."""
    asked = 0
    idle = False


def _stop(signum: int, _frame: object) -> None:
    _Stop.asked = _Stop.asked or signum
    if _Stop.idle:
        raise _Stopped(signum)


if __name__ == "__main__":
    from training.node import warm as _self  # run from the module, so a child's __main__ is the worker's own

    _self.main()
