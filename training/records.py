"""A run's records: timestamped events the node agents and the trainer append to the run's
bucket, read back by `python -m training.goodput report` (training/goodput_report.py).

Each writer (one node agent boot, one trainer process, one watchdog) owns one object,
`<CHECKPOINT_URL>/records/<node>-<boot>-<role>-<pid>-<random>.jsonl`, and rewrites only that one:
object stores cannot append, and no two processes ever write the same object (the random part: a
restarted container's processes get the same pids again). One JSON line per event,
its schema versioned (`v`) and checked with pydantic when read:

    python -m training.records node-start          # the entrypoint: capacity requested, booted, gate passed, started
    python -m training.records emit failure --failure xid --detail "Xid 79"
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from training.ckpt.storage import Location

log = logging.getLogger("gts.records")
# The hang watchdog's "dump your Python stacks" to the trainer (faulthandler runs in C, GIL or not).
STACKS_SIGNAL = signal.SIGRTMIN + 2

SCHEMA_VERSION: Literal[1] = 1
Kind = Literal["capacity_requested", "node_booted", "gate_passed", "agent_started", "first_step", "checkpoint", "failure",
               "straggler", "run_finished"]
FailureKind = Literal["reclaim", "xid", "hang", "crash", "straggler_replacement"]
# What each kind of event must carry besides its time, run and node.
NEEDS: dict[str, tuple[str, ...]] = {"first_step": ("step",), "checkpoint": ("step", "blocked_s"),
                                     "failure": ("failure",), "straggler": ("rank", "excess_s")}


EARLIEST = 1577836800.0  # 2020-01-01: no run's event is older
NonNegative = Annotated[float, Field(ge=0)]
Count = Annotated[int, Field(ge=0)]


class Event(BaseModel):
    """One event of a run (schema version 1). No NaN or infinity, no negative duration or step, no
    time before 2020 or over a day ahead: one bad line would bend every figure of the report."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    v: Literal[1] = SCHEMA_VERSION  # the schema version
    t: float  # unix time, seconds
    kind: Kind
    run: str  # the run's id (records.run_id)
    team: str = ""  # GTS_TEAM: whom the run's cost is shown back to
    node: str = ""  # the node (GTS_NODE_NAME, else the host name)
    rank: Count | None = None  # a rank the event is about (hang, straggler)
    step: Count | None = None  # first_step: the step the attempt resumed from; checkpoint: its step
    blocked_s: NonNegative | None = None  # checkpoint: seconds the training loop was blocked
    failure: FailureKind | None = None
    committed_step: Annotated[int, Field(ge=-1)] | None = None  # failure: the newest committed step then (-1: none)
    last_progress_t: float | None = None  # hang: when any rank last finished a step
    excess_s: NonNegative | None = None  # straggler: seconds the run waited for the slow rank over the window
    node_hourly_usd: NonNegative | None = None  # node_booted: the node's price (the plan's, from the catalog)
    tier: Literal["peer"] | None = None  # checkpoint: "peer" for a copy to the peer tier, else the checkpoint's own
    detail: str = ""

    @field_validator("t", "last_progress_t")
    @classmethod
    def _a_real_time(cls, value: float | None) -> float | None:
        if value is not None and not EARLIEST <= value <= time.time() + 86400:
            raise ValueError(f"{value} is not a time between 2020-01-01 and a day from now (unix seconds)")
        return value

    @model_validator(mode="after")
    def _complete(self) -> Event:
        missing = [name for name in NEEDS.get(self.kind, ()) if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.kind} event needs {', '.join(missing)}")
        return self


def run_id(env: dict[str, str] | None = None) -> str:
    """The run's id: GTS_RUN_ID, else its node group and checkpoint URL (a run is its checkpoints)."""
    env = dict(os.environ) if env is None else env
    if env.get("GTS_RUN_ID"):
        return env["GTS_RUN_ID"]
    url = (env.get("CHECKPOINT_URL") or env.get("CHECKPOINT_DIR") or "local").rstrip("/")
    return f"{env.get('GTS_NODE_GROUP') or 'local'}:{url.rsplit('/', 1)[-1]}"


def node_name() -> str:
    return os.environ.get("GTS_NODE_NAME") or socket.gethostname()


def boot_time() -> float:
    """When this machine booted: GTS_BOOT_TIME where the bootstrap (or a test) knows better, else
    /proc/stat's btime; the process start elsewhere."""
    if os.environ.get("GTS_BOOT_TIME"):
        return float(os.environ["GTS_BOOT_TIME"])
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return time.time()


def proc_start(pid: int) -> int | None:
    """The process's start time (/proc/<pid>/stat field 22, clock ticks since boot): with the pid,
    it names one process, whatever pid reuse or a new pid namespace does; None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return "noboot"


class Writer:
    """Appends events to this process's own object under `<url>/records/`. A failed upload is
    logged and retried with the next event: records never stop training. `background`: uploads
    in a thread of their own (the training loop does not wait for the bucket); flush() at the end."""

    def __init__(self, url: str | None, role: str, background: bool = False):
        self.url = url
        self.lines: list[str] = []
        # the random part: pids repeat in a restarted container's new pid namespace, the boot id with it
        self.name = f"{node_name()}-{_boot_id()}-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self.base = {"run": run_id(), "team": os.environ.get("GTS_TEAM", ""), "node": node_name()}
        self.written = 0  # lines in the bucket
        self.lock, self.uploading = threading.Lock(), threading.Lock()
        self._where: Location | None = None  # the store, made at the first upload (under `uploading`)
        self.wake = threading.Event()
        if url and background:
            threading.Thread(target=self._uploads, daemon=True, name="gts-records").start()
        self.background = bool(url and background)

    def emit(self, kind: str, **fields: object) -> Event:
        event = Event.model_validate({"t": time.time(), "kind": kind, **self.base, **fields})
        with self.lock:
            self.lines.append(event.model_dump_json(exclude_none=True))
        if self.background:
            self.wake.set()
        else:
            self.upload()
        return event

    def upload(self) -> bool:
        """The whole object, as it is now; True once the bucket has every line."""
        if not self.url:
            return True
        with self.uploading:  # one upload at a time: an older copy never lands after a newer one
            with self.lock:
                lines = list(self.lines)
            if len(lines) == self.written:
                return True
            try:
                from training.ckpt.storage import location

                # one store for every upload (each a new client was ~0.15 s of CPU beside the loop); a new
                # one after a failure
                where = self._where = self._where or location(self.url)
                where.fs.pipe(where.join("records", self.name), ("\n".join(lines) + "\n").encode())
            except Exception as exc:  # noqa: BLE001 - an unreachable bucket must not stop the run
                self._where = None
                log.warning("run records not written to %s: %s", self.url, exc)
                return False
            self.written = len(lines)
            return True

    def _uploads(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            self.upload()

    def flush(self, timeout: float = 30.0) -> None:
        """Every event in the bucket, or `timeout` s tried."""
        deadline = time.monotonic() + timeout
        while not self.upload() and time.monotonic() < deadline:
            time.sleep(1.0)


class BadRecords(ValueError):
    """A records object that does not follow the schema (the message names it and the line)."""


def parse(name: str, text: str) -> list[Event]:
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(Event.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the line"
            raise BadRecords(f"{name} line {number}: {where}: {first['msg']} (schema version {SCHEMA_VERSION}, "
                             "training/records.py)") from None
    return events


def read(url: str) -> list[Event]:
    """Every event under `<url>/records/` (or `url` itself when it is that folder), by time."""
    from training.ckpt.storage import location

    where = location(url)
    root = where.root if where.root.rstrip("/").endswith("/records") else where.join("records")
    if not where.fs.exists(root):
        raise BadRecords(f"{url}: no records/ folder there (the run's CHECKPOINT_URL holds it)")
    events: list[Event] = []
    for path in sorted(where.fs.find(root)):
        if path.endswith(".jsonl"):
            events += parse(path.rsplit("/", 1)[-1], where.fs.cat_file(path).decode("utf-8", "replace"))
    return sorted(events, key=lambda e: e.t)


def _served_another_run() -> bool:
    """Whether this boot of the machine already served another run (a long-lived or reused node):
    then its boot says nothing about this run. A marker per boot on the node's scratch disk
    (which outlives containers) names the first run the boot served."""
    marker = Path(os.environ.get("GTS_SCRATCH_DIR") or "/scratch") / f".gts-boot-{_boot_id()}"
    try:
        if marker.is_file():
            return marker.read_text().strip() != run_id()
        marker.write_text(run_id() + "\n")
    except OSError:
        pass
    return False


def _node_start(writer: Writer) -> None:
    """The entrypoint's events: capacity requested (GTS_LAUNCH_TIME, the instance's launch time
    where the bootstrap knows it, else the boot), booted, and the GPU gate passed (its marker).
    On a machine whose boot already served another run, this run starts now, not at the boot."""
    if os.environ.get("GTS_LAUNCH_TIME") is None and os.environ.get("GTS_BOOT_TIME") is None and _served_another_run():
        writer.emit("capacity_requested")
        writer.emit("node_booted", node_hourly_usd=float(os.environ.get("NODE_HOURLY_USD") or 0))
        writer.emit("agent_started")
        return
    booted = boot_time()
    launched = float(os.environ.get("GTS_LAUNCH_TIME") or booted)
    price = float(os.environ.get("NODE_HOURLY_USD") or 0)
    writer.emit("capacity_requested", t=min(launched, booted))
    writer.emit("node_booted", t=booted, node_hourly_usd=price)
    marker = Path(os.environ.get("GTS_GATE_MARKER") or "/nonexistent")
    if marker.is_file():
        writer.emit("gate_passed", t=marker.stat().st_mtime)
    writer.emit("agent_started")  # the entrypoint: what follows until the first step is start-up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.records", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("node-start")
    emit = sub.add_parser("emit")
    emit.add_argument("kind")
    for name in ("failure", "detail"):
        emit.add_argument(f"--{name}")
    for name in ("rank", "step", "committed-step"):
        emit.add_argument(f"--{name}", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    writer = Writer(os.environ.get("CHECKPOINT_URL") or os.environ.get("CHECKPOINT_DIR"), args.command)
    try:
        if args.command == "node-start":
            _node_start(writer)
        else:
            fields = {k: v for k, v in (("failure", args.failure), ("detail", args.detail), ("rank", args.rank),
                                        ("step", args.step), ("committed_step", args.committed_step)) if v is not None}
            writer.emit(args.kind, **fields)
    except ValidationError as exc:
        print(f"records: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
