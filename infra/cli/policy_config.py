"""`make policy-config STACK=<name>`: the policy pack's config for a real preview of that stack,
as out/policy-config-<stack>.json (infra/stack/policy_config.py: the env's file plus the stack's CNY
rate, budget, thresholds and planned monthly cost). Prints the file's path:

    pulumi preview --stack prod --policy-pack policies --policy-pack-config $(make -s policy-config STACK=prod)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infra.core.errors import CatalogError, InputError, SpecError, out_error
from infra.stack import policy_config
from infra.stack.stackfile import StackFileError, load_stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make policy-config", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="dev")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    try:
        config = policy_config.for_stack(args.stack, load_stack(args.stack))
    except (SpecError, StackFileError, CatalogError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = args.out / f"policy-config-{args.stack}.json"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"error: {out_error('OUT', args.out, exc)}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
