"""`make userdata STACK=<name> OUT=<dir>`: every node group's cloud-config as <out>/<cloud>-<group>.yaml."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infra import userdata
from infra.errors import SpecError
from infra.stackfile import StackFileError, load_stack


def write_all(stack: str, out: Path) -> list[Path]:
    stack_ = load_stack(stack)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for group in stack_.groups:
        # The trainer image is known by digest only once `pulumi up` has pushed it.
        ctx = userdata.node_context(stack_.spec, group, userdata.IMAGE_PLACEHOLDER)
        target = out / f"{group.cloud}-{group.name}.yaml"
        target.write_text(userdata.render(ctx), encoding="utf-8")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make userdata", description="write each node group's cloud-config")
    parser.add_argument("--stack", default="dev")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        for path in write_all(args.stack, args.out):
            print(path)
    except (SpecError, StackFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
