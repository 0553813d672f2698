#!/usr/bin/env python3
"""The stacks a workflow runs on, from the checkout's stack files, as `list=<json>` for
$GITHUB_OUTPUT: every `Pulumi.<name>.yaml` whose name is [a-z0-9-] (any other name is refused:
it becomes a matrix value that reaches commands).

    python3 .ci/stacks.py                     # every stack (drift)
    python3 .ci/stacks.py --without-production  # pull-request previews: no production stack
    python3 .ci/stacks.py --teams               # the generated team stacks (deploys)

A production stack is `prod` and every stack checked against the prod policies: a stack file
with `gpu-training-stack:env: prod`, or a team stack whose team takes `policies: prod`
(teams.yaml; its generated file says so). Pull-request previews leave them out, because a
preview runs the branch's code with the stack's secrets decrypted. That is convenience only:
the branch can edit this file, so what keeps prod's secrets from a branch is that the
`preview` environment's Pulumi token cannot decrypt them (docs/ci.md).
Standard library only: it runs before any virtualenv exists."""

import argparse
import glob
import json
import re
import sys

NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
PRODUCTION = re.compile(r"^\s*(gpu-training-stack:env:\s*prod|policies:\s*prod)\s*$", re.MULTILINE)


def stacks(without_production: bool = False, teams: bool = False) -> list:
    found = sorted(p[len("Pulumi."):-len(".yaml")] for p in glob.glob("Pulumi.*.yaml"))
    bad = [n for n in found if not NAME.fullmatch(n)]
    if bad:
        raise SystemExit("stack file names must be [a-z0-9-], not %s" % bad)
    if teams:
        found = [n for n in found if n.startswith("team-")]
    if without_production:
        found = [n for n in found if n != "prod"
                 and not PRODUCTION.search(open("Pulumi.%s.yaml" % n, encoding="utf-8").read())]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without-production", action="store_true")
    parser.add_argument("--teams", action="store_true")
    args = parser.parse_args()
    print("list=" + json.dumps(stacks(args.without_production, args.teams)))


if __name__ == "__main__":
    sys.exit(main())
