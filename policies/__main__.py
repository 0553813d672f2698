"""The policy pack: `pulumi preview --policy-pack policies --policy-pack-config <config>`.

Self-contained, as `pulumi policy publish` ships it: its code is gts_policy/ next to this file,
its data is data/, its dependencies are requirements.txt; nothing is imported from the
project around it. The CLI runs this file with the pack's folder first on the module path.

Resource rules (one resource at a time: metadata tokens, disk encryption, passwords, tags,
protection, instance families, API endpoints) are resource validation policies, which the
engine runs on each resource before it is created and which remediate where the fix is safe;
rules over several resources (cost and node caps, spot share, ingress per security group,
bucket settings, budget) are stack validation policies.

Importing this module starts the policy gRPC server and never returns.
"""

from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    PolicyPack,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from gts_policy.resources import Res
from gts_policy.rules import RULES, Rule

LEVELS = {"mandatory": EnforcementLevel.MANDATORY, "advisory": EnforcementLevel.ADVISORY,
          "remediate": EnforcementLevel.REMEDIATE, "disabled": EnforcementLevel.DISABLED}


def _view(resource_type: str, name: str, props: Any, protect: bool) -> Res:
    return Res(resource_type, name, props, protect)


def _resource_policy(rule: Rule) -> ResourceValidationPolicy:
    check, fix = rule.per_resource, rule.remediate
    assert check is not None

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        res = _view(args.resource_type, args.name, args.props, bool(args.opts.protect))
        for message in check(res, args.get_config()):
            report_violation(f"[{rule.name}] {args.name}: {message}", args.urn)

    def remediate(args: ResourceValidationArgs) -> Any:
        assert fix is not None
        return fix(_view(args.resource_type, args.name, args.props, bool(args.opts.protect)))

    return ResourceValidationPolicy(
        name=rule.name, description=rule.description, validate=validate,
        remediate=remediate if fix is not None else None, enforcement_level=LEVELS[rule.enforcement],
        config_schema=PolicyConfigSchema(properties=rule.schema))


def _stack_policy(rule: Rule) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        resources = [_view(r.resource_type, r.name, r.props, bool(r.opts.protect)) for r in args.resources]
        urns = {r.name: r.urn for r in args.resources}
        for name, message in rule.run(resources, args.get_config()):
            report_violation(f"[{rule.name}] {name}: {message}", urns.get(name))

    return StackValidationPolicy(
        name=rule.name, description=rule.description, validate=validate,
        enforcement_level=LEVELS[rule.enforcement], config_schema=PolicyConfigSchema(properties=rule.schema))


PolicyPack(name="gpu-training-stack",
           policies=[_resource_policy(r) if r.per_resource is not None else _stack_policy(r) for r in RULES])
