"""The policy pack for `pulumi preview --policy-pack policies --policy-pack-config policies/<env>.json`.

Importing this module starts the policy gRPC server and never returns: tests import
policies.rules instead.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pulumi_policy import (  # noqa: E402
    EnforcementLevel,
    PolicyConfigSchema,
    PolicyPack,
    ReportViolation,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.resources import Res  # noqa: E402
from policies.rules import RULES, Rule  # noqa: E402

LEVELS = {"mandatory": EnforcementLevel.MANDATORY, "advisory": EnforcementLevel.ADVISORY,
          "disabled": EnforcementLevel.DISABLED}


def _policy(rule: Rule) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        resources = [Res(r.resource_type, r.name, r.props, bool(r.opts.protect)) for r in args.resources]
        urns = {r.name: r.urn for r in args.resources}
        for name, message in rule.check(resources, args.get_config()):
            report_violation(f"[{rule.name}] {name}: {message}", urns.get(name))

    return StackValidationPolicy(
        name=rule.name, description=rule.description, validate=validate,
        enforcement_level=LEVELS[rule.enforcement],
        config_schema=PolicyConfigSchema(properties=rule.schema))


PolicyPack(name="gpu-training-stack", policies=[_policy(r) for r in RULES])
