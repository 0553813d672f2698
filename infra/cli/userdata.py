"""`make userdata STACK=<name> OUT=<dir>`: every node group's cloud-config as <out>/<cloud>-<group>.yaml."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infra import userdata
from infra.core.errors import InputError, SpecError, out_error
from infra.stack.stackfile import StackFileError, load_stack


def write_all(stack: str, out: Path) -> list[Path]:
    stack_ = load_stack(stack)
    # The trainer image is known by digest only once `pulumi up` has pushed it.
    files = {out / f"{group.cloud}-{group.name}.yaml":
             userdata.render(userdata.node_context(stack_.spec, group, userdata.IMAGE_PLACEHOLDER))
             for group in stack_.groups}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for target, text in files.items():
            target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise out_error("OUT", out, exc) from None
    return list(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make userdata", description="write each node group's cloud-config")
    parser.add_argument("--stack", default="dev")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        for path in write_all(args.stack, args.out):
            print(path)
    except (SpecError, StackFileError, ValueError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
