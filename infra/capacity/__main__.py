"""`python -m infra.capacity watch --stack <name> [--once] [--every SECONDS] [--move-back]`: the
capacity broker (infra/capacity/broker.py) over one stack, through Pulumi's Automation API
(needs the Pulumi CLI and the stack's backend, and the operator's keys of each cloud: the ones
`pulumi up` uses). Prints one line per group and watch; exit 0, 1 when a watch failed (the
next run tries again; an `up` that failed mid-move, set back and recorded; a group whose fleet the
stack's outputs show elsewhere), 2 on bad input; a watch that finds another watch of the stack
running says so and exits 0. docs/capacity.md: from CI's schedule, a cron on a small
node, or a CronJob."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from infra.buckets import Bucket, endpoint
from infra.capacity.broker import STALE_AFTER_S, Broker, Busy, Decision, MoveFailed
from infra.capacity.workspace import uncommitted
from infra.cli.dataset import DatasetError, operator_keys
from infra.core.errors import SpecError
from infra.model.stacktext import STACK_NAME, project_root
from training.ckpt.storage import Location, location
from training.trainer.config import TrainConfig

UPLOAD_DEADLINE_S = TrainConfig.upload_deadline_s  # the trainer's default wait for its uploads on exit


def storage_for(where: Bucket, url: str) -> Location:
    """A URL in one of the stack's buckets from outside its cloud: the public endpoint and the
    operator's keys (as `make dataset`)."""
    env = {**os.environ, "STORAGE_ENDPOINT_URL": endpoint(where.cloud, where.region, node_region=""),
           "STORAGE_REGION": where.region}
    return location(url, env, operator_keys(where.cloud, os.environ))


def _line(d: Decision) -> str:
    skipped = "; ".join(f"skipped capacity[{s['index']}] ({s['calls']} calls): {s['why']}" for s in d.skipped)
    copied = (f"; copied step {d.copied.step} ({d.copied.files} files, {d.copied.bytes} bytes) and "
              f"{d.copied.dataset_files} dataset files, verified" if d.copied else "")
    return f"{d.group}: {d.action} (place {d.at}): {d.reason}{copied}{'; ' + skipped if skipped else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.capacity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    watch = sub.add_parser("watch", help="watch the stack's groups and move them where there is capacity")
    watch.add_argument("--stack", required=True, help="the Pulumi stack (its Pulumi.<stack>.yaml)")
    watch.add_argument("--once", action="store_true", help="one watch, then exit (CI, cron, CronJob)")
    watch.add_argument("--every", type=int, default=60, help="seconds between watches (default 60)")
    watch.add_argument("--move-back", action="store_true", help="move a group back where it is declared once it "
                                                                "has stock there again")
    watch.add_argument("--stale-after", type=float, default=STALE_AFTER_S,
                       help="seconds after which a half-written checkpoint step whose newest object is older is "
                            f"abandoned, not waited for (default {STALE_AFTER_S:g})")
    args = parser.parse_args(argv)
    if not STACK_NAME.fullmatch(args.stack):
        print(f"error: --stack {args.stack!r} is not a stack name (letters, digits, . _ -)", file=sys.stderr)
        return 2
    if args.every < 10:
        print(f"error: --every {args.every}: watch at most every 10 seconds (the clouds' API rate limits)",
              file=sys.stderr)
        return 2
    if args.stale_after < UPLOAD_DEADLINE_S:
        print(f"error: --stale-after {args.stale_after:g}: at least the trainer's --upload-deadline-s default "
              f"({UPLOAD_DEADLINE_S:g} s), above the longest one-file upload", file=sys.stderr)
        return 2
    try:
        workspace = _workspace(args.stack)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dirty = uncommitted(project_root(), args.stack)
    if dirty:
        print(f"error: --stack {args.stack}: {dirty} (a move lands in the stack file; the next deploy from the "
              "repository would undo a move made on another file: docs/capacity.md)", file=sys.stderr)
        return 2
    broker = Broker(workspace, storage=storage_for, move_back=args.move_back, stale_after_s=args.stale_after)
    while True:
        code = _watch(broker)
        if args.once:
            return code
        time.sleep(args.every)
        while dirty := uncommitted(project_root(), args.stack):  # a move to commit: no watch on a changed file
            print(f"waiting: {dirty} (the last move)", file=sys.stderr, flush=True)
            time.sleep(args.every)


def _workspace(stack: str) -> Any:
    from infra.capacity.workspace import AutomationWorkspace

    try:
        return AutomationWorkspace(stack, project_root())
    except FileNotFoundError:
        raise RuntimeError("the Pulumi CLI is not installed: the Automation API drives it (pulumi.com/docs/install)") \
            from None
    except Exception as exc:  # noqa: BLE001 (the Automation API's CommandError and its kin)
        raise RuntimeError(f"stack {stack}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}") \
            from None


def _watch(broker: Broker) -> int:
    try:
        decisions = broker.once()
    except Busy as exc:
        print(f"skipped: {exc}", flush=True)
        return 0
    except MoveFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (SpecError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 (a cloud API or storage error: the next watch tries again)
        print(f"error: the watch stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for decision in decisions:
        print(_line(decision), flush=True)
    return 1 if any(d.action == "mismatch" for d in decisions) else 0


if __name__ == "__main__":
    sys.exit(main())
