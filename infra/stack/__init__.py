"""The stack end to end: a stack file read and checked (stackfile), the Pulumi program that
builds it (program), the policy pack's config. Only the CLIs (infra/cli, plan, teams,
capacity, prices) sit above it.

Modules: stackfile, program, policy_config."""
