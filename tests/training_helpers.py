"""Real processes for the trainer tests: torchrun / accelerate launches with timeouts, a moto
S3 server on 127.0.0.1, and a TCP proxy in front of it to simulate a storage outage."""

from __future__ import annotations

import os
import re
import selectors
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from training.node.guard import descendants as descendants  # every process below a pid, from /proc

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FINAL = re.compile(r"^final step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64})$", re.M)
LAUNCH_TIMEOUT = 180
FAULT_ENV = {"PYTHONFAULTHANDLER": "1"}  # a run that hangs in a test shows its Python stacks (Run.stacks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """`sig` to `pid` and everything below it, at once: what a node's loss does to its processes."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


@dataclass
class Run:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = LAUNCH_TIMEOUT) -> str:
        """The first output line matching `pattern`. The wait ends at once when the process ends
        without it; the deadline only guards against a hang, so it is the launch's own (a 60 s one
        failed a full run on a loaded machine while the trainer was still starting its workers)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if regex.search(line):
                    return line
            if self.proc.poll() is not None and self._reader is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.output[-4000:]}")

    def finish(self, timeout: float = LAUNCH_TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s: {self.stacks()}") from None
        if self._reader is not None:
            self._reader.join(timeout=10)
        return code

    def stacks(self) -> str:
        """A run that does not end, as text: every process's state and wait channel; then, one
        process at a time with the rest stopped (SIGSTOP: none reacts to another's end), the most
        telling first (a single-threaded process waiting on a lock before one polling), its native
        stacks (gdb, where installed, for the first few) and its Python stacks (faulthandler on
        SIGABRT: FAULT_ENV), each under its pid; then the tree killed and the run's last lines. The
        CI log keeps the head of a failure's text: what names the hang comes first."""
        tree = [self.proc.pid, *descendants(self.proc.pid)]
        states = subprocess.run(["ps", "-o", "pid,ppid,nlwp,stat,wchan:22,args", "-p", ",".join(map(str, tree))],
                                capture_output=True, text=True).stdout
        states = "\n".join(line[:160] for line in states.splitlines())  # a command line can be a script
        last = "\n".join(self.lines[-12:])
        kill_tree(self.proc.pid, signal.SIGSTOP)
        sections = []
        for rank, pid in enumerate(sorted(tree, key=lambda p: _telling(states, p))):
            native = _native_stacks(pid) if rank < NATIVE_STACKS else ""
            sections.append(f"--- pid {pid}: {_row(states, pid)[:120]}\n{native}{self._python_stacks(pid)}")
        for pid in {*tree, *descendants(self.proc.pid)}:  # by then the root's children may be init's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(timeout=15)
        self.proc.wait(timeout=30)
        return f"its processes:\n{states}\n" + "\n".join(sections) + f"\n--- its last lines before:\n{last}"

    def _python_stacks(self, pid: int, quiet: float = 0.3, limit: float = 10.0) -> str:
        """The lines `pid` writes once SIGABRT'd and continued (faulthandler's dump; the process
        then ends): read until it has ended and nothing new came for `quiet` seconds."""
        before = len(self.lines)
        for sig in (signal.SIGABRT, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline, seen, since = time.monotonic() + limit, before, time.monotonic()
        while time.monotonic() < deadline:
            if len(self.lines) != seen:
                seen, since = len(self.lines), time.monotonic()
            elif not _alive(pid) and time.monotonic() - since > quiet:
                break
            time.sleep(0.05)
        return "\n".join(self.lines[before:])[:STACKS_CHARS]

    def final(self) -> tuple[int, str, str]:
        match = FINAL.search(self.output)
        assert match, f"no final line:\n{self.output[-4000:]}"
        return int(match.group(1)), match.group(2), match.group(3)


NATIVE_STACKS = 3  # processes whose native stacks are read (gdb takes seconds each)
STACKS_CHARS = 2500  # of each process's Python stacks
IDLE_WAITS = ("poll_schedule", "do_wait", "ep_poll", "do_select", "hrtimer_nanosleep", "do_sigtimedwait")


def _row(states: str, pid: int) -> str:
    return next((" ".join(line.split()) for line in states.splitlines()[1:] if line.split()[:1] == [str(pid)]), "gone")


def _telling(states: str, pid: int) -> tuple[int, int]:
    """Sort key: a process waiting on something other than its children, a poll or a sleep first;
    of those, a single-threaded one first (a lock no thread of its own will release); a zombie,
    a running one and one gone since last."""
    fields = _row(states, pid).split()
    if len(fields) < 5 or not fields[2].isdigit() or fields[3].startswith("Z") or fields[4] == "-":
        return (2, 1)
    return (1 if fields[4].startswith(IDLE_WAITS) else 0, 0 if int(fields[2]) == 1 else 1)


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie and not gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _native_stacks(pid: int) -> str:
    """Each thread's innermost native frames (function and library), from gdb where installed."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set auto-load off",
                              "-ex", "thread apply all bt 10"], capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return "(gdb: no answer in 60 s)\n"
    frames = []
    for line in out.splitlines():
        if line.startswith("Thread "):
            frames.append(line.split("(LWP", 1)[0] + line[line.find('"'):].strip())
        elif match := re.match(r"#(\d+) +(?:0x[0-9a-f]+ in )?(\S+) .*?(?:from (\S+)|at (\S+))?$", line):
            frames.append(f"  #{match.group(1)} {match.group(2)} {Path(match.group(3) or match.group(4) or '').name}")
    return "\n".join(frames)[:2000] + "\n"


def launch(args: list[str], cwd: Path, env: dict[str, str] | None = None, accelerate: bool = False,
           nproc: int = 2) -> Run:
    """torchrun (or accelerate) with `nproc` CPU processes (two unless told); GTS_TEST_* faults in
    `env` run the trainer through tests/faults.py, which injects them."""
    base = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **FAULT_ENV}
    base.update(env or {})
    module = "tests.faults" if any(k.startswith("GTS_TEST_") for k in (env or {})) else "training.trainer.train"
    if accelerate:
        base["ACCELERATE_USE_CPU"] = "1"
        cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1",
               "--main_process_port", str(free_port()), "-m", module, "--launcher", "accelerate", *args]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "-m", module, *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    run = Run(proc)
    run.start_reader()
    return run


class MotoServer:
    """`moto_server` on 127.0.0.1 with one bucket."""

    def __init__(self, bucket: str = "gts-test"):
        self.port = free_port()
        self.bucket = bucket
        self.proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        self.client().create_bucket(Bucket=bucket)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, port: int | None = None):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port or self.port}", region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing",
                            config=Config(s3={"addressing_style": "path"}))

    def keys(self, prefix: str = "") -> list[str]:
        return self.keys_in(self.bucket, prefix)

    def keys_in(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def storage_env(endpoint: str) -> dict[str, str]:
    return {"STORAGE_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "STORAGE_ADDRESSING_STYLE": "path"}


# The access key in an Authorization header: SigV4 (Credential=<key>/...) or V2 (AWS <key>:<sig>).
SIGNED_BY = re.compile(rb"(?i)authorization: (?:AWS4-HMAC-SHA256 Credential=([^/\s]+)/|AWS ([^:\s]+):)")


class Proxy:
    """A TCP forwarder 127.0.0.1:port -> target that can go down and come back on the same port.
    It notes the access key of every SigV4-signed request it forwards (`signed_by`): which
    credentials a client really used."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.signed_by: set[str] = set()
        self.port = free_port()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self.up()

    def up(self) -> None:
        self._stop = threading.Event()
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        server.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, args=(server, self._stop), daemon=True)
        self._thread.start()

    def down(self) -> None:
        assert self._stop is not None and self._thread is not None
        self._stop.set()
        self._thread.join(timeout=5)

    def _serve(self, server: socket.socket, stop: threading.Event) -> None:
        conns: list[socket.socket] = []
        with server:
            while not stop.is_set():
                try:
                    client, _ = server.accept()
                except TimeoutError:
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.target))
                conns += [client, upstream]
                threading.Thread(target=self._pipe, args=(client, upstream, stop, self.signed_by), daemon=True).start()
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket, stop: threading.Event, signed_by: set[str]) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(a, selectors.EVENT_READ, b)  # the proxy may already be down
            sel.register(b, selectors.EVENT_READ, a)
            while not stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.fileobj is a:
                        signed_by.update((v4 or v2).decode() for v4, v2 in SIGNED_BY.findall(data))
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass


def retry_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


RDZV_TEST_KEY = "local-test-key-" + "0" * 32  # a group's rendezvous key (training/node/rdzv_launch.py), for loopback runs


@contextlib.contextmanager
def rendezvous_store() -> Iterator[int]:
    """The nodes' rendezvous store (training/node/rdzv_store.py) on a free loopback port: its port once
    it listens; stopped afterwards."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "training.node.rdzv_store", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield port
    finally:
        store.terminate()
        store.wait(timeout=10)


@contextlib.contextmanager
def elastic_cluster() -> Iterator[tuple[MotoServer, int, list[Run]]]:
    """What a multi-node test runs in: a bucket on moto, a rendezvous store apart from the nodes
    (as the stack runs it), and the list the test appends its nodes to. Whatever happens, every node
    still running is killed with its process tree, then the store and moto are stopped."""
    moto = MotoServer()
    nodes: list[Run] = []
    try:
        with rendezvous_store() as port:
            try:
                yield moto, port, nodes
            finally:
                for run in nodes:
                    if run.proc.poll() is None:
                        kill_tree(run.proc.pid)
    finally:
        moto.stop()


def elastic_node(tmp: Path, index: int, port: int, moto: MotoServer, args: list[str], **env: str) -> Run:
    """One "node" of an elastic multi-node run on loopback: the image's entrypoint with the
    contract a VM node gets (its checkpoint folder, the bucket, the store at `port`, the group's
    rendezvous key); `env` sets NNODES, MIN_NNODES, NPROC_PER_NODE, CHECKPOINT_URL, TRAIN_STEPS..."""
    full = {**os.environ, **storage_env(moto.url), "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun",
            "RDZV_ENDPOINT": f"127.0.0.1:{port}", "GTS_NODE_GROUP": "local", "RDZV_KEY": RDZV_TEST_KEY,
            "CHECKPOINT_DIR": str(tmp / f"node{index}"), **env}
    proc = subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh"), *args], env=full, cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = Run(proc)
    run.start_reader()
    return run


def wait_any(nodes: list[Run], pattern: str, timeout: float, after: dict[int, int] | None = None) -> tuple[int, str]:
    """(node, line) of the first line matching `pattern` on any node, among each node's lines
    after `after[node]` (which node holds which rank is the rendezvous' choice)."""
    deadline = time.monotonic() + timeout
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        for i, run in enumerate(nodes):
            for line in list(run.lines)[(after or {}).get(i, 0):]:
                if regex.search(line):
                    return i, line
        time.sleep(0.1)
    raise AssertionError(f"no node printed {pattern!r}:\n" + "\n---\n".join(r.output[-2500:] for r in nodes))
