"""`python -m infra.plan --stack dev [--format json]`: the stack, offline.

Reads Pulumi.<stack>.yaml as the Pulumi CLI would, runs the stack program (infra/stack/program.py, what
__main__.py runs) on the stack read here in the mock engine, and
prints every resource with its key inputs, the cost summary and the policy verdicts. With
--format json, stdout holds exactly one JSON document. Exit codes: 0 ok, 1 a mandatory policy
violation, 2 an invalid stack (the message names the key), 3 an internal error (one line; the
traceback with --debug).
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # One short process over a heap of about a million long-lived objects (the provider SDKs'
    # classes and type hints): the cyclic collector's full passes walk all of them again and again
    # and took 40-50 % of the plan's time while freeing about 5 MB of 285 (measured, prod). The
    # plan runs without it, from before its imports; reference counting still frees the rest.
    # (Only as `python -m infra.plan`: a process that imports this module keeps its collector.)
    gc.disable()

import argparse
import asyncio
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pulumi
from rich.console import Console
from rich.markup import escape

from infra.core.errors import CatalogError, InputError, SpecError
from infra.plan import plan_json, report
from infra.plan.engine import DuplicateUrn, Registered, run_program, unwrap_secrets
from infra.plan.invokes import COMPUTED, INVOKES
from infra.plan.replacements import replacements
from infra.prices import age
from infra.render import protection
from infra.resolve import fabric_plan, gpu_health
from infra.resolve.cost import stack_cost
from infra.resolve.groups import Stack
from infra.stack import policy_config, program
from infra.stack.stackfile import StackFileError, project_name, read_stack_file, stack_from_values, stack_path


def policy_verdicts(stack: str, resolved: Stack, resources: list[Registered],
                    planned: float | None = None) -> list[dict[str, str]]:
    """The policy pack's rules on what the program registered, with the config a real preview
    gets (`make policy-config`: the env's file plus the stack's rate, budget and planned cost,
    `planned` where the caller has it)."""
    from policies.gts_policy.resources import Res
    from policies.gts_policy.rules import OFFLINE_ADVISORY, evaluate
    config = policy_config.for_stack(stack, resolved, planned)
    views = [Res(r.type, r.name, unwrap_secrets(r.inputs), bool(r.options.get("protect"))) for r in resources]
    verdicts = evaluate(views, config)
    for v in verdicts:  # mandatory in a real preview; the offline plan of an example stack still plans
        if v["policy"] in OFFLINE_ADVISORY and v["enforcement"] == "mandatory":
            v["enforcement"] = "advisory"
            v["message"] += " (advisory offline; mandatory in a real preview with the policy pack)"
    return verdicts


def registered(stack: str) -> tuple[str, Stack, list[Registered]]:
    """The stack's project, its resolved spec and the resources its program registers."""
    project = project_name()
    path = stack_path(stack)
    config = read_stack_file(path, project)
    # The stack read, checked, resolved and sized once, here, before any resource; the program
    # builds this one (pulumi up reads the same values from Pulumi's config instead).
    resolved = program.sized(stack_from_values(config.values, project, path.name), path.name)
    return project, resolved, run_program(config, INVOKES, COMPUTED, program=lambda: program.main(resolved))


def build_plan(stack: str, against: Path | None = None) -> dict[str, Any]:
    project, resolved, resources = registered(stack)
    cost = stack_cost(resolved)
    rendered = [{"type": r.type, "name": r.name, "urn": r.urn, "parent": r.parent, "provider": r.provider,
                 "protect": bool(r.options.get("protect")), "retainOnDelete": bool(r.options.get("retainOnDelete")),
                 "aliases": list(r.options.get("aliases", [])), "inputs": r.masked()} for r in resources]
    cost["prices"] = age.summary(resolved)
    violations = policy_verdicts(stack, resolved, resources, cost["monthly_usd"])
    plan = {"stack": stack, "project": project, "resources": rendered, "cost": cost,
            "violations": violations + fabric_plan.advisories(resolved) + gpu_health.advisories(resolved.groups)}
    if against is not None:
        base = earlier_plan(against)
        kinds = protection.stateful_types()
        plan["replacements"] = replacements(base["resources"], rendered, {t: k.why for t, k in kinds.items()},
                                            {t: k.replace_on for t, k in kinds.items()})
    return plan


def earlier_plan(path: Path) -> dict[str, Any]:
    """An earlier `--format json` plan, or an InputError naming --against and what it is instead."""
    def refuse(why: str) -> InputError:
        return InputError(f"--against {path}: {why}; pass a plan written by `make plan FORMAT=json > plan.json`")

    try:
        if not path.is_file():
            raise refuse("is not a file" if path.exists() else "does not exist")
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror})") from None
    except ValueError as exc:  # not JSON, not UTF-8
        raise refuse(f"is not JSON ({str(exc).splitlines()[0]})") from None
    resources = data.get("resources") if isinstance(data, dict) else None
    if not isinstance(resources, list) or not all(isinstance(r, dict) and {"urn", "type", "inputs"} <= set(r)
                                                  for r in resources):
        raise refuse("is JSON but not a plan (no resources list with urn, type and inputs)")
    return dict(data)


REPORT = "report it with the command and the stack file (docs/not-proven.md lists known gaps)"


def internal_error(exc: BaseException, debug: bool, err: Console) -> int:
    """A fault of this tool, not of the stack file: one line (the traceback with --debug), exit 3."""
    if debug:
        err.print_exception()
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    err.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))}{at}; {REPORT}; "
              "rerun with --debug for the traceback", markup=True, highlight=False)
    return 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="dev", help="stack name: reads Pulumi.<stack>.yaml")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--against", type=Path, metavar="PLAN_JSON",
                        help="an earlier `--format json` plan: mark stateful resources this one would replace")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an internal error")
    args = parser.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)
    try:
        plan = build_plan(args.stack, args.against)
    except (SpecError, StackFileError, CatalogError, DuplicateUrn, pulumi.RunError, InputError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
        return 2
    except Exception as exc:  # noqa: BLE001 (a bug here, not the user's: exit 3, one line)
        return internal_error(exc, args.debug, err)
    if args.format == "json":
        sys.stdout.write(plan_json.dumps(plan) + "\n")
    else:
        report.print_plan(plan, Console(width=report.width(sys.stdout.isatty(), dict(os.environ))))
    mandatory = [v for v in plan["violations"] if v["enforcement"] == "mandatory"]
    return 1 if mandatory else 0


if __name__ == "__main__":
    code = main()
    # Close the loop the mock engine ran on, or its finaliser complains at interpreter exit.
    asyncio.get_event_loop().close()
    sys.exit(code)
