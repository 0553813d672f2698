"""What a training process tells the rest of the node and the run's records about its progress:

- a heartbeat per rank (`$GTS_PROGRESS_DIR/rank-<rank>`: step, time, p99 step time, the newest
  saved step, pid, node, until when the rank is busy outside its steps (a save, the final
  uploads), and the process's start time) that the node's hang watchdog reads (training/node/watchdog.py), and Python
  stacks dumped by faulthandler to `stacks-rank<rank>.txt` when the watchdog sends STACKS_SIGNAL;
- global rank 0's run records (training/records.py): the attempt's first step, each checkpoint's
  blocked time, a crash, the run's end;
- straggler detection: every STRAGGLER_WINDOW_STEPS steps the ranks gather their compute time
  (forward and optimizer; the backward pass is where DDP waits for the others' gradients, so it
  is kept apart as collective wait) and a rank slower than STRAGGLER_FACTOR x the median is
  flagged with its node: a log line, the gts_train_straggler metric and a record.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import torch

from training import records
from training.distributed import Comm

log = logging.getLogger("gts.progress")
STACKS_SIGNAL = records.STACKS_SIGNAL
PERSISTENT_WINDOWS = 3  # a rank flagged this many windows in a row is a persistent straggler
# The run's records are read at the first step, or this long after the trainer set up its progress if
# no step came first (a long start, or one that dies before a step, still shows the run's own start)
RUN_STARTED_READ_S = 30.0


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value else default


class GpuTimes:
    """Forward and optimizer time as the GPU ran them: a CUDA event at four points of each step,
    read once a window. On a GPU the host's clock sees only the kernels' launch; a slow GPU's time
    would land in the step's first synchronisation, on every rank alike, and no rank would stand out."""

    def __init__(self, event: Any = None):
        self.event = event or torch.cuda.Event
        self.marks: list[Any] = []

    def mark(self) -> None:
        event = self.event(enable_timing=True)
        event.record()
        self.marks.append(event)

    def seconds(self) -> float:
        """The window's forward + optimizer seconds (mark 0 -> 1 and 2 -> 3 of each step); resets."""
        steps = [self.marks[i:i + 4] for i in range(0, len(self.marks) - 3, 4)]
        self.marks = []
        if not steps:
            return 0.0
        steps[-1][3].synchronize()
        return float(sum(a.elapsed_time(b) + c.elapsed_time(d) for a, b, c, d in steps)) / 1000


class Progress:
    def __init__(self, comm: Comm, records_url: str | None, metrics: Any):
        self.comm, self.metrics = comm, metrics
        self.dir = Path(os.environ["GTS_PROGRESS_DIR"]) if os.environ.get("GTS_PROGRESS_DIR") else None
        self.writer = records.Writer(records_url, "trainer", background=True) if comm.rank == 0 else None
        self.times: deque[float] = deque(maxlen=500)
        self.window = int(_setting("STRAGGLER_WINDOW_STEPS", 50))
        self.factor = _setting("STRAGGLER_FACTOR", 1.2)
        self.replace = os.environ.get("STRAGGLER_REPLACE", "false").lower() == "true"
        self.compute = self.waited = 0.0
        self.gpu = GpuTimes() if self.window and getattr(comm, "device", None) is not None \
            and comm.device.type == "cuda" else None
        self.flagged: dict[int, int] = {}  # rank -> windows in a row
        self.first_done = False
        self.saved, self.blocked = -1, 0.0
        self.step = -1  # the newest step finished
        self.started = records.proc_start(os.getpid())  # with the pid, names this process to the watchdog
        self._stacks: IO[str] | None = None
        if self.dir is not None:
            self._stacks = open(self.dir / f"stacks-rank{comm.rank}.txt", "w", encoding="utf-8")  # noqa: SIM115
            faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)

        # read after the first step: at the start the store's client and listing would take CPU the resume needs
        self.records_url = records_url if comm.local_rank == 0 and metrics is not None else None
        self._run_read = threading.Lock()
        self._run_asked = False
        self._run_timer: threading.Timer | None = None
        if self.records_url:
            self._run_timer = threading.Timer(RUN_STARTED_READ_S, self._read_run_started)
            self._run_timer.daemon = True
            self._run_timer.start()

    def _read_run_started(self) -> None:
        """The run's start read from its records, once: at the first step or RUN_STARTED_READ_S."""
        with self._run_read:
            if self._run_asked or not self.records_url:
                return
            self._run_asked = True
        if self._run_timer is not None:
            self._run_timer.cancel()
        threading.Thread(target=self._run_started, args=(self.records_url,), daemon=True).start()

    def _run_started(self, url: str) -> None:
        """The live ETTR's denominator starts when the run first asked for capacity (its records);
        until it is read, this process's start."""
        try:
            found = [e.t for e in records.read(url) if e.run == records.run_id()]
        except Exception as exc:  # noqa: BLE001 - no records yet, or the bucket unreachable: this process's start
            log.info("no run records read from %s (%s): ETTR counted from this process's start", url, exc)
            return
        if found:
            self.metrics.run_started.set(min(found))

    def record(self, kind: str, **fields: object) -> None:
        if self.writer is not None:
            self.writer.emit(kind, **fields)

    def mark(self, value: float) -> float:
        """On a GPU, a timing event at this point of the step (GpuTimes); returns `value` as it is."""
        if self.gpu is not None:
            self.gpu.mark()
        return value

    def stepped(self, step: int, elapsed: float, compute: float) -> None:
        """After every optimizer step, on every rank."""
        now = time.time()
        if not self.first_done:
            self.first_done = True
            self.record("first_step", step=step - 1, detail=f"world {self.comm.world}")
            self._read_run_started()
        self.times.append(elapsed)
        self.compute += compute
        self.waited += max(0.0, elapsed - compute)
        self.step = step
        self._beat(now)
        if self.window and step % self.window == 0:
            self.compare(step)

    def _beat(self, now: float, until: float = 0.0) -> None:
        if self.dir is None:
            return
        # a checkpoint blocks the loop too: the watchdog's limit is 3x the longer of the two
        p99 = max(sorted(self.times)[int(0.99 * (len(self.times) - 1))], self.blocked) if self.times else self.blocked
        beat = self.dir / f"rank-{self.comm.rank}"
        tmp = self.dir / f".rank-{self.comm.rank}.tmp"  # no `rank-*` name: the watchdog drops those it can't read
        tmp.write_text(f"{self.step} {now:.3f} {p99:.4f} {self.saved} {os.getpid()} {records.node_name()} "
                       f"{until:.3f} {self.started}\n")
        os.replace(tmp, beat)

    def busy(self, seconds: float) -> None:
        """Before work outside the steps (a save, the final uploads): the watchdog leaves this rank
        alone until now + seconds. The next step's heartbeat ends it."""
        if self.step >= 0:  # before the first step there is no heartbeat: nothing is watched yet
            now = time.time()
            self._beat(now, now + seconds)

    def saved_checkpoint(self, step: int, blocked: float) -> None:
        self.saved, self.blocked = step, max(self.blocked, blocked)
        if self.metrics is not None and self.times:
            self.metrics.productive.set(step * statistics.median(self.times))
        self.record("checkpoint", step=step, blocked_s=blocked)

    def peer_copy(self, peer: Any, step: int, state: dict[str, Any] | None, rng: dict[str, Any],
                  budget_s: float | None = None) -> None:
        """A copy to the peer tier (training/ckpt/peer/tier.py; `budget_s`: a stop's, waited for that
        long at most), recorded as a checkpoint of tier "peer": an attempt resumed from it lost only
        the work after it."""
        skipped = peer.skipped
        blocked = peer.copy(step, state, rng, budget_s=budget_s)
        if self.metrics is not None:
            self.metrics.peer_blocked.set(blocked)
        if peer.skipped == skipped:  # sent (a copy still on its way when the next is due is skipped)
            self.record("checkpoint", step=step, blocked_s=blocked, tier="peer")

    def compare(self, step: int) -> None:
        """Every rank: gather the window's compute times and flag the slow ones (one collective)."""
        if self.gpu is not None:  # the GPU's own time for forward and optimizer; the rest of the step waited
            gpu = self.gpu.seconds()
            self.compute, self.waited = gpu, self.waited + max(0.0, self.compute - gpu)
        mine = (self.compute, self.waited, records.node_name())
        self.compute = self.waited = 0.0
        gathered = self.comm.all_gather_object(mine)
        if len(gathered) < 2:
            return
        median = statistics.median_low(c for c, _, _ in gathered)
        for rank, (compute, waited, node) in enumerate(gathered):
            slow = median > 0 and compute > self.factor * median
            self.flagged[rank] = self.flagged.get(rank, 0) + 1 if slow else 0
            if self.metrics is not None and rank == self.comm.rank:  # each process its own: no other node's ranks
                self.metrics.straggler.labels(**self.metrics.labels, rank=str(rank)).set(
                    compute / median if median > 0 else 0)
            if not slow:
                continue
            if self.comm.rank == 0:
                log.warning("straggler: rank %d on node %s computed %.3f s over steps %d-%d, %.2fx the median "
                            "rank's %.3f s (collective wait %.3f s)", rank, node, compute, step - self.window + 1,
                            step, compute / median, median, waited)
                self.record("straggler", rank=rank, excess_s=compute - median, step=step,
                            detail=f"node {node}: {compute / median:.2f}x the median over {self.window} steps")
            if self.replace and self.flagged[rank] >= PERSISTENT_WINDOWS and rank == self.comm.rank:
                self.ask_replacement(node, step)

    def ask_replacement(self, node: str, step: int) -> None:
        """This rank is a persistent straggler: its node's watchdog asks for the node's replacement."""
        if self.dir is not None:
            (self.dir / "replace-request").write_text(f"straggler: rank {self.comm.rank} slow for "
                                                      f"{PERSISTENT_WINDOWS} windows at step {step}\n")
        log.warning("persistent straggler: rank %d on node %s asks for its node's replacement", self.comm.rank, node)

    def crashed(self, exc: BaseException, committed: int) -> None:
        """The process is going down with an exception: its record goes to the bucket first."""
        self.record("failure", failure="crash", committed_step=committed, detail=repr(exc)[:300])
        if self.writer is not None:
            self.writer.flush(timeout=10.0)

    def ended(self, interrupted: str | None, code: int, step: int) -> None:
        """The attempt's end: the run finished, or a signal stopped it after an emergency checkpoint
        (a reclaim notice, or a person: nothing is lost either way)."""
        if interrupted is None and code == 0:
            self.record("run_finished", step=step)
        elif interrupted is not None and code in (0, 75):  # 75: another node was told to stop (run_control.finish)
            self.record("failure", failure="reclaim", committed_step=self.saved, detail=f"{interrupted} at step {step}")
        self.close()

    def close(self) -> None:
        with self._run_read:  # no read starts after the close (a timer firing now included)
            self._run_asked = True
        if self._run_timer is not None:
            self._run_timer.cancel()
        if self.writer is not None:
            self.writer.flush()
        if self._stacks is not None:
            faulthandler.unregister(STACKS_SIGNAL)
            self._stacks.close()
            self._stacks = None
