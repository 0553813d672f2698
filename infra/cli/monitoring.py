"""`make monitoring STACK=<name> OUT=<dir>`: the stack's Prometheus alerting rules and Grafana dashboard."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infra import monitoring
from infra.core.errors import SpecError, out_error
from infra.stack.stackfile import StackFileError, load_stack_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make monitoring",
                                     description="write the stack's Prometheus alerting rules and Grafana dashboard")
    parser.add_argument("--stack", default="dev")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        spec = load_stack_spec(args.stack)
    except (SpecError, StackFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        written = monitoring.write_all(spec, args.stack, args.out)
    except OSError as exc:
        print(f"error: {out_error('OUT', args.out, exc)}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
