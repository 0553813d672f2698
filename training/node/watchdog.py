"""The node's hang watchdog, run beside the launcher by training/node/entrypoint.sh.

Every training process writes a heartbeat after each step (training/trainer/progress.py:
`$GTS_PROGRESS_DIR/rank-<rank>` with its step, the time, its p99 step time (or its longest
checkpoint's blocked time, if longer), its newest saved step, its pid, and until when it is busy
outside its steps: a rank writes "busy until now + its upload deadline" before each save and
before its final uploads, and the watchdog leaves the node alone until then; it stands down too
once the entrypoint is stopping (`stopping` in the progress folder: the workers are writing their
emergency checkpoint). When no local rank has finished a step for max(3 x the p99 step time,
HANG_TIMEOUT_S) — NCCL's own watchdog waits 10 minutes, gloo's 30 — the watchdog:

1. has every worker dump its Python stacks (faulthandler, registered by the trainer on
   records.STACKS_SIGNAL; a stopped process is continued after the signal is queued, so the dump shows
   the frame it stopped in), with NCCL's flight recorder dumps where NCCL wrote any;
2. kills the workers: the launcher restarts the worker group (--max-restarts) from the newest
   checkpoint, and the other nodes' workers, their collective broken, restart with them;
3. keeps the dump in `<progress dir>/hangs/` and, in threads (an unreachable bucket must not
   hold the restart), copies it to `<CHECKPOINT_URL>/records/hangs/<node>-<time>.txt` and
   records the hang (training/records.py): the suspect rank (a stopped or uninterruptible
   process here, else the rank whose heartbeat is oldest) and its node, the newest saved step.

HANG_RESTARTS (3) hangs in a row with no step finished between them (a hang that every restart
meets again) stop the restarts: the watchdog stops the node's launcher (exit non-zero), says so in
one line and records it.

A node that is the suspect of HANG_REPLACE_AFTER hangs (2) asks its group for its replacement
through the replace-me path (training/node/node_replace.py), after a slot of the group's
replacement budget (training/node/replace_budget.py, as the GPU watch takes one), as does a node whose rank asked for
it as a persistent straggler (`replace-request` in the progress folder; STRAGGLER_REPLACE).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import records
from training.records import STACKS_SIGNAL

log = logging.getLogger("gts.watchdog")
HANG_REPLACE_AFTER = 2
STACKS_WAIT_S = 5.0
UPLOAD_WAIT_S = 30.0  # at exit, for uploads still in flight


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    t: float
    p99: float
    saved: int
    pid: int
    until: float = 0.0  # busy outside the steps (a save, the final uploads) until then


def beats(folder: Path, launcher: int) -> list[Beat]:
    """The heartbeats of the launcher's workers alive now. Any other file (a restarted group's, a
    stale one naming a pid now reused, one left by an earlier container) is removed unread: only a
    process below the launcher whose start time is the heartbeat's is ever signalled."""
    found = []
    for path in folder.glob("rank-*"):
        if not path.name.removeprefix("rank-").isdigit():
            continue  # not a heartbeat's name (an older trainer's `rank-N.tmp`, written as it was read)
        try:
            fields = path.read_text().split()
            step, t, p99, saved, pid = fields[:5]
            until, started = float(fields[6]), int(fields[7])
            beat = Beat(int(path.name.split("-")[1]), int(step), float(t), float(p99), int(saved), int(pid), until)
        except (OSError, ValueError, IndexError):
            beat, started = None, -1
        if beat is not None and _state(beat.pid) and records.proc_start(beat.pid) == started and \
                _below(beat.pid, launcher):
            found.append(beat)
        else:
            path.unlink(missing_ok=True)
    return found


def _below(pid: int, ancestor: int) -> bool:
    """Whether `pid` descends from `ancestor` (its parents' chain, from /proc)."""
    for _ in range(64):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def _state(pid: int) -> str:
    """The process's state letter (R, S, D, T, t, Z...), '' when it is gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return "" if state in ("Z", "X") else state


def limit(found: list[Beat], floor: float) -> float:
    return max(3 * max(b.p99 for b in found), floor)


class Watchdog:
    def __init__(self, folder: Path, url: str | None, floor: float, replace: bool, launcher: int):
        self.folder, self.url, self.floor, self.replace, self.launcher = folder, url, floor, replace, launcher
        self.writer = records.Writer(url, "watchdog", background=True)  # the bucket never holds a restart
        self.uploads: list[threading.Thread] = []
        self.handled: set[int] = set()  # pids of worker groups already stopped for a hang
        self.own_hangs = 0
        self.budget = 3  # hangs in a row with no step between them before the workers stay down (HANG_RESTARTS)
        self.in_a_row, self.hung_at = 0, -1  # such hangs so far; the newest step at the last one
        self.replaced = False

    def check(self, now: float) -> bool:
        """One look; True when it found a hang and acted."""
        found = [b for b in beats(self.folder, self.launcher) if b.pid not in self.handled]
        if self.replace and not self.replaced and (self.folder / "replace-request").is_file():
            self.ask_replacement((self.folder / "replace-request").read_text().strip(), "straggler_replacement")
        if not found or now - max(b.t for b in found) <= limit(found, self.floor):
            return False
        if any(b.until > now for b in found):  # a rank saves or uploads: the others wait for it in a collective
            return False
        self.act(found, now)
        return True

    def act(self, found: list[Beat], now: float) -> None:
        """Stacks dumped here first, the workers killed next, the bucket last (in a thread: an
        unreachable bucket must not hold the restart). Giving up, the record is flushed before the
        launcher is stopped (at most UPLOAD_WAIT_S): the node's run ends with the launcher."""
        last = max(b.t for b in found)
        stuck = [b for b in found if _state(b.pid) in ("T", "t", "D")]
        suspect = stuck[0] if stuck else min(found, key=lambda b: (b.t, b.rank))
        log.error("hang: no step on ranks %s of node %s for %.0f s (limit %.0f s); suspect rank %d (%s); saving "
                  "stacks and restarting the workers", sorted(b.rank for b in found), records.node_name(), now - last,
                  limit(found, self.floor), suspect.rank, "stopped" if stuck else "oldest heartbeat")
        text = self.dump_stacks(found, suspect, bool(stuck))
        newest = max(b.step for b in found)
        self.in_a_row = self.in_a_row + 1 if newest <= self.hung_at else 1
        self.hung_at = max(self.hung_at, newest)
        give_up = self.in_a_row >= self.budget
        name = f"{records.node_name()}-{int(time.time())}.txt"
        kept = self.folder / "hangs" / name
        kept.parent.mkdir(exist_ok=True)
        kept.write_text(text)
        where = f"{self.url.rstrip('/')}/records/hangs/{name} (kept at {kept})" if self.url else str(kept)
        self.writer.emit("failure", failure="hang", rank=suspect.rank, committed_step=max(b.saved for b in found),
                         last_progress_t=last, detail=f"{'suspect' if stuck else 'peer'}: node {records.node_name()} "
                         f"rank {suspect.rank}; stacks {where}" + (f"; {self.in_a_row} hangs in a row without a step "
                                                                    "between them: not restarted" if give_up else ""))
        if give_up:  # the record lands first (the node's run ends with the launcher), then the launcher: it
            # must not start the workers again; the workers are hung, so nothing restarts them meanwhile
            log.error("watchdog: %d hangs in a row with no step past %d between them (HANG_RESTARTS=%d): not "
                      "restarting the workers; the node's launcher is stopped, read the stacks in %s/hangs/",
                      self.in_a_row, newest, self.budget, self.folder)
            self.writer.flush(timeout=UPLOAD_WAIT_S)
            _signal(self.launcher, signal.SIGTERM)
        for beat in found:
            self.handled.add(beat.pid)
            _signal(beat.pid, signal.SIGKILL)
        upload = threading.Thread(target=self.upload_stacks, args=(kept,), daemon=True, name="gts-hang-stacks")
        upload.start()
        self.uploads.append(upload)
        if stuck:
            self.own_hangs += 1
            if self.own_hangs >= HANG_REPLACE_AFTER and self.replace:
                self.ask_replacement(f"{self.own_hangs} hangs on this node", "hang")

    def dump_stacks(self, found: list[Beat], suspect: Beat, stopped: bool) -> str:
        """Every worker's Python stacks (and NCCL flight recorder dumps), as one text."""
        files = {b.rank: self.folder / f"stacks-rank{b.rank}.txt" for b in found}
        before = {r: (p.stat().st_size if p.exists() else 0) for r, p in files.items()}
        for beat in found:
            _signal(beat.pid, STACKS_SIGNAL)
            _signal(beat.pid, signal.SIGCONT)  # a stopped process runs the handler once continued
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline and any(_size(p) <= before[r] for r, p in files.items()):
            time.sleep(0.1)
        # A dump is written thread by thread (the main thread's often last): read it once no file has
        # grown for a few polls in a row, not a fixed moment after it began (a loaded node, many threads).
        sizes, still = {r: _size(p) for r, p in files.items()}, 0
        while still < 3 and time.monotonic() < deadline + STACKS_WAIT_S:
            time.sleep(0.1)
            now = {r: _size(p) for r, p in files.items()}
            still, sizes = (still + 1 if now == sizes else 0), now
        parts = [f"hang on node {records.node_name()} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; "
                 f"suspect rank {suspect.rank} ({'stopped' if stopped else 'oldest heartbeat'})"]
        for beat in found:
            text = files[beat.rank].read_text(errors="replace")[before[beat.rank]:] if files[beat.rank].exists() else ""
            parts.append(f"== rank {beat.rank} pid {beat.pid} last step {beat.step}\n{text or '(no stacks dumped)'}")
        parts += [f"== {p.name}\n{p.read_bytes()[:200000]!r}" for p in sorted(self.folder.glob("nccl_trace_rank_*"))]
        return "\n".join(parts)

    def upload_stacks(self, kept: Path) -> None:
        """The dump to `<url>/records/hangs/`; the local copy stays either way."""
        if not self.url:
            return
        try:
            from training.ckpt.storage import location

            where = location(self.url)
            where.fs.pipe(where.join("records", "hangs", kept.name), kept.read_bytes())
        except Exception as exc:  # noqa: BLE001 - the copy in the progress folder is kept
            log.error("stacks not saved to %s (kept at %s): %s", self.url, kept, exc)

    def drain(self, timeout: float = UPLOAD_WAIT_S) -> None:
        """At exit: the uploads in flight get `timeout` s more, then are left (their dumps stay here)."""
        deadline = time.monotonic() + timeout
        for upload in self.uploads:
            upload.join(max(0.0, deadline - time.monotonic()))
        self.writer.flush(timeout=max(0.0, deadline - time.monotonic()))

    def ask_replacement(self, why: str, kind: str) -> None:
        """The node's replace-me request (training/node/node_replace.py), as the GPU health watch makes it."""
        self.replaced = True
        log.error("asking for this node's replacement: %s", why)
        if kind != "hang":  # a hang's replacement follows its own hang record
            self.writer.emit("failure", failure="straggler_replacement", detail=f"replacement asked: {why}")
        try:
            from training import cloudmeta
            sys.modules.setdefault("cloudmeta", cloudmeta)  # node_replace imports it as the node installs it
            from training.node import node_replace

            meta = cloudmeta.Metadata(os.environ.get("GTS_CLOUD", ""), os.environ.get("GTS_METADATA_URL") or None)
            if not self.budgeted(meta, why):
                return
            instance, answer = node_replace.request_replacement(
                meta, None, os.environ.get("GTS_REPLACE_API_URL") or None, os.environ.get("GTS_NODE_GROUP", ""),
                os.environ.get("GTS_SCALING_GROUP_ID", ""))
            log.warning("asked the group to replace instance %s: %s", instance, answer.strip()[:300])
        except Exception as exc:  # noqa: BLE001 - the node stays; the hang records name it for the operator
            log.error("replacement request failed: %s", exc)


    def budgeted(self, meta: Any, why: str) -> bool:
        """A slot of the group's replacement budget (training/node/replace_budget.py, as the GPU
        watch's replacements take): over budget or unreadable, the node is not replaced (fail safe)."""
        from training import cloudmeta
        from training.node import replace_budget

        try:
            per_hour = replace_budget.per_hour_setting(os.environ.get("GTS_REPLACEMENTS_PER_HOUR"))
            if per_hour == 0:  # no bound
                return True
            try:
                creds = meta.credentials()
                instance = meta.get(cloudmeta.cloud_node(meta.cloud).INSTANCE_ID_PATH) or "unknown"
            except (OSError, ValueError, KeyError, cloudmeta.MetadataError) as exc:
                raise replace_budget.Unreachable(f"the instance role's credentials: {exc}") from None
            taken, detail = replace_budget.take(os.environ, per_hour, instance, why, creds)
        except (replace_budget.Unreachable, ValueError) as exc:
            log.error("%s: the group's replacement budget could not be read (%s); this node is NOT replaced", why, exc)
            return False
        if not taken:
            log.error("%s: the group's replacement budget is spent (%s); this node is NOT replaced", why, detail)
        return taken


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _unsafe(folder: Path) -> str:
    """Why the progress folder cannot be trusted ('' when it can): not ours, or open to others."""
    try:
        st = folder.stat()
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"has mode {oct(st.st_mode & 0o777)}"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.node.watchdog", allow_abbrev=False)
    parser.add_argument("--progress-dir", default=os.environ.get("GTS_PROGRESS_DIR", ""))
    parser.add_argument("--parent", type=int, default=os.getppid(), help="exit when this process is gone")
    parser.add_argument("--launcher", type=int, help="only processes below this one are watched (default: --parent)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    unsafe = _unsafe(Path(args.progress_dir))
    if unsafe:
        print(f"watchdog: GTS_PROGRESS_DIR={args.progress_dir!r} {unsafe}; the watchdog signals the pids named "
              "there, so it must be a folder of this user's alone: chmod 700 it or leave GTS_PROGRESS_DIR unset",
              file=sys.stderr)
        return 2
    from training.contract import HANG_RESTARTS, HANG_TIMEOUT_S, HANG_REPLACE

    floor = float(os.environ.get(HANG_TIMEOUT_S.name) or 60)
    replace = (os.environ.get(HANG_REPLACE.name) or "true").lower() == "true"
    dog = Watchdog(Path(args.progress_dir), os.environ.get("CHECKPOINT_URL") or os.environ.get("CHECKPOINT_DIR"),
                   floor, replace, args.launcher or args.parent)
    budget = os.environ.get(HANG_RESTARTS.name) or "3"
    if not budget.isdigit() or int(budget) < 1:
        print(f"watchdog: HANG_RESTARTS={budget!r} is not a whole number of hangs >= 1 (default 3)", file=sys.stderr)
        return 2
    dog.budget = int(budget)
    log.info("hang watchdog on %s: a hang is max(3 x p99 step time, %.0f s) without a step", args.progress_dir, floor)
    while _state(args.parent):
        if (dog.folder / "stopping").exists():  # TERM / INT: the workers write their emergency checkpoints
            log.info("the entrypoint is stopping: the hang watchdog stands down")
            break
        dog.check(time.time())
        time.sleep(1.0)
    dog.drain()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
