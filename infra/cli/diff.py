"""`make diff BASE=<git ref> [STACK=<name>|all] [FORMAT=md|json]`: what the working tree changes
against a git ref, stack by stack — resources added / changed / removed / replaced (data- and
capacity-holding replacements flagged), the monthly cost before and after, new and resolved
policy verdicts. The base is planned in a temporary worktree with the same virtualenv, offline.
Exit codes as `make plan`: 1 when the change brings a new mandatory violation, 2 when a plan of
the working tree is invalid (or the ref does not exist)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from infra.plan import markdown
from infra.plan.diff import diff_plans, new_mandatory
from infra.stack.stackfile import StackFileError, check_stack_name, project_root


class DiffError(Exception):
    pass


def _git(*args: str, cwd: Path) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise DiffError("git is not installed: make diff plans the stacks at a git ref (BASE=); install git, or "
                        "compare two `make plan FORMAT=json` files with make plan AGAINST=<earlier plan>") from None
    if proc.returncode != 0:
        said = "; ".join(line for line in proc.stderr.strip().splitlines() if line.strip())
        raise DiffError(f"git {' '.join(args)}: {said or f'exit {proc.returncode}'}")
    return proc.stdout


def empty_plan(stack: str) -> dict[str, Any]:
    return {"stack": stack, "resources": [], "violations": [],
            "cost": {"monthly_usd": 0.0, "by_cloud": {}, "node_groups": []}}


def plan(folder: Path, stack: str) -> tuple[dict[str, Any] | None, str]:
    """(the plan of `stack` in `folder`, or None when it does not exist or is invalid; why)."""
    if not (folder / f"Pulumi.{stack}.yaml").exists():
        return None, "no such stack there"
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"], cwd=folder,
                          capture_output=True, text=True, env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"})
    if proc.returncode in (0, 1):
        return json.loads(proc.stdout), ""
    return None, proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else f"exit {proc.returncode}"


def stacks_of(folder: Path) -> set[str]:
    return {p.name[len("Pulumi."):-len(".yaml")] for p in folder.glob("Pulumi.*.yaml")}


def compare(base_ref: str, stack: str, head: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    _git("rev-parse", "--verify", f"{base_ref}^{{commit}}", cwd=head)
    with tempfile.TemporaryDirectory(prefix="gts-diff-") as tmp:
        base = Path(tmp) / "base"
        _git("worktree", "add", "--detach", str(base), base_ref, cwd=head)
        try:
            names = sorted(stacks_of(head) | stacks_of(base)) if stack == "all" else [stack]
            reports, errors = [], {}
            for name in names:
                new, why = plan(head, name)
                if new is None and (head / f"Pulumi.{name}.yaml").exists():
                    errors[name] = why
                    continue
                old, _ = plan(base, name)
                reports.append(diff_plans(old or empty_plan(name), new or empty_plan(name)))
            return reports, errors
        finally:
            _git("worktree", "remove", "--force", str(base), cwd=head)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make diff", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git ref to compare with (a branch, tag, HEAD~1)")
    parser.add_argument("--stack", default="all", help="a stack name, or all")
    parser.add_argument("--format", choices=("md", "json"), default="md")
    args = parser.parse_args(argv)
    try:
        if args.stack != "all":
            check_stack_name(args.stack)
        reports, errors = compare(args.base, args.stack, project_root())
    except (DiffError, StackFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps({"base": args.base, "stacks": reports, "errors": errors}, indent=2))
    else:
        print(markdown.render(reports, args.base, errors), end="")
    if errors:
        return 2
    return 1 if any(new_mandatory(r) for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
