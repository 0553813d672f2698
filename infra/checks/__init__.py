"""The check phase: what a stack is judged by before any resource exists (validation.py runs
them all: values, each cloud's rules, the resolved groups, the training commands). Imports
resolve and below; no Pulumi resource code.

Modules: value_checks, cloud_rules, resolved_checks, commands, validation."""
