"""`python -m infra.plan --stack dev [--format json]`: the stack, offline.

Reads Pulumi.<stack>.yaml as the Pulumi CLI would, runs __main__.py in the mock engine, and
prints every resource with its key inputs, the cost summary and the policy verdicts. With
--format json, stdout holds exactly one JSON document. Exit codes: 0 ok, 1 mandatory policy
violation, 2 invalid stack config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pulumi
from rich.console import Console
from rich.markup import escape

from infra import protection
from infra.cost import stack_cost
from infra.errors import CatalogError, SpecError
from infra.groups import resolve
from infra.plan import report
from infra.plan.engine import DuplicateUrn, Registered, run_program, unwrap_secrets
from infra.plan.invokes import COMPUTED, INVOKES
from infra.plan.replacements import replacements
from infra.stackfile import StackFileError, project_name, project_root, read_stack_file, spec_from_values, stack_path
from infra.spec import StackSpec


def policy_verdicts(spec: StackSpec, stack: str, resources: list[Registered]) -> list[dict[str, str]]:
    """The policy pack's rules on what the program registered, with the stack's (or its env's)
    policy config file, exactly as `--policy-pack-config policies/<env>.json` would apply."""
    from policies.resources import Res
    from policies.rules import evaluate
    folder = project_root() / "policies"
    path = next((p for p in (folder / f"{stack}.json", folder / f"{spec.env}.json") if p.exists()), None)
    config = json.loads(path.read_text()) if path else {}
    config = {k: ({**v, "cnyPerUsd": spec.pricing.cny_per_usd} if isinstance(v, dict) else v)
              for k, v in config.items()}
    views = [Res(r.type, r.name, unwrap_secrets(r.inputs), bool(r.options.get("protect"))) for r in resources]
    return evaluate(views, config)


def build_plan(stack: str, against: Path | None = None) -> dict[str, Any]:
    project = project_name()
    path = stack_path(stack)
    config = read_stack_file(path, project)
    spec = spec_from_values(config.values, project, path.name)  # fails before any resource
    resources = run_program(config, INVOKES, COMPUTED)
    cost = stack_cost(resolve(spec))
    rendered = [{"type": r.type, "name": r.name, "urn": r.urn, "parent": r.parent, "provider": r.provider,
                 "protect": bool(r.options.get("protect")), "retainOnDelete": bool(r.options.get("retainOnDelete")),
                 "aliases": list(r.options.get("aliases", [])), "inputs": r.masked()} for r in resources]
    plan = {"stack": stack, "project": project, "resources": rendered, "cost": cost,
            "violations": policy_verdicts(spec, stack, resources)}
    if against is not None:
        base = json.loads(against.read_text(encoding="utf-8"))
        kinds = protection.stateful_types()
        plan["replacements"] = replacements(base["resources"], rendered, {t: k.why for t, k in kinds.items()},
                                            {t: k.replace_on for t, k in kinds.items()})
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="dev", help="stack name: reads Pulumi.<stack>.yaml")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--against", type=Path, metavar="PLAN_JSON",
                        help="an earlier `--format json` plan: mark stateful resources this one would replace")
    args = parser.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)
    try:
        plan = build_plan(args.stack, args.against)
    except (SpecError, StackFileError, CatalogError, DuplicateUrn, pulumi.RunError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
        return 2
    if args.format == "json":
        sys.stdout.write(json.dumps(plan, indent=2, sort_keys=False) + "\n")
    else:
        report.print_plan(plan, Console(width=None if sys.stdout.isatty() else 180))
    mandatory = [v for v in plan["violations"] if v["enforcement"] == "mandatory"]
    return 1 if mandatory else 0


if __name__ == "__main__":
    code = main()
    # Close the loop the mock engine ran on, or its finaliser complains at interpreter exit.
    asyncio.get_event_loop().close()
    sys.exit(code)
