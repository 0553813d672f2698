"""Reading a stack the way the Pulumi CLI hands it to the program, at the edge: the program
(`pulumi up`), the offline plan, `make teams` and the `make userdata` / `make monitoring`
commands read the stack file, its spec and the team registry it names here, once, and hand
them down; nothing under validation or building reads a file. The file's text is read by
infra/model/stacktext.py (its names are importable from here as well).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

from infra.checks import validation
from infra.model import spec as spec_mod
from infra.resolve.groups import Stack
from infra.model.stacktext import (CREDENTIAL_KEYS, PROVIDER_NAMESPACES, SCALAR_KEYS, SECRET_MASK, STACK_NAME,
                             URL_PASSWORD, StackConfig, StackFileError, available_stacks, check_stack_name, decode,
                             is_generated, load_yaml, project_name, project_root, read_stack_file, read_stack_text,
                             read_text, secrets_in_clear, stray_keys)
from infra.teams import registry
from infra.teams.generate import stack_drift

__all__ = ["CREDENTIAL_KEYS", "PROVIDER_NAMESPACES", "SCALAR_KEYS", "SECRET_MASK", "STACK_NAME", "URL_PASSWORD",
           "StackConfig", "StackFileError", "available_stacks", "check_stack_name", "decode", "is_generated",
           "load_yaml", "project_name", "project_root", "read_stack_file", "read_stack_text", "secrets_in_clear",
           "stray_keys", "stack_path", "teams_reader", "spec_from_values", "stack_from_values", "load_stack_spec",
           "load_stack"]

def stack_path(stack: str, root: Path | None = None) -> Path:
    """`Pulumi.<stack>.yaml`, or a StackFileError naming the stacks that exist."""
    root = root or project_root()
    path = root / f"Pulumi.{check_stack_name(stack)}.yaml"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        read_text(path)  # a link to nothing, a directory, a FIFO: refused by its kind, never opened
    if not path.exists():
        raise StackFileError(f"no stack file {path.name}; stacks here: {', '.join(available_stacks(root))} "
                             f"(create Pulumi.{stack}.yaml or pass STACK=<one of them>)")
    drift = stack_drift(path, root)  # a generated team stack must match its registry
    if drift:
        raise StackFileError(f"{path.name}: " + "; ".join(drift))
    return path


def teams_reader(root: Path | None = None) -> validation.TeamsReader:
    """The team registries a stack names (kubernetes.queues), each read from `root` (default: the
    project's) once for the caller that holds this reader, and handed to validation."""
    folder = root or project_root()
    return functools.lru_cache(maxsize=None)(functools.partial(registry.load, folder))


def stack_from_values(values: Mapping[str, str], project: str, source: str,
                      teams: validation.TeamsReader | None = None) -> Stack:
    """The checked spec with its groups resolved from a full config map (`<project>:<key>` ->
    string), as `make plan` reads it; the registry a queued stack names is read with `teams`
    (default: from the project's folder)."""
    return validation.parse_values(values, project, source, teams or teams_reader())


def spec_from_values(values: Mapping[str, str], project: str, source: str,
                     teams: validation.TeamsReader | None = None) -> spec_mod.StackSpec:
    """The spec alone, the same way."""
    return stack_from_values(values, project, source, teams).spec


def load_stack(stack: str, root: Path | None = None) -> Stack:
    """`Pulumi.<stack>.yaml`, read as pulumi would, checked and resolved (make userdata / monitoring)."""
    root = root or project_root()
    path = stack_path(stack, root)
    project = project_name(root)
    return stack_from_values(read_stack_file(path, project).values, project, path.name, teams_reader(root))


def load_stack_spec(stack: str, root: Path | None = None) -> spec_mod.StackSpec:
    """The spec of `Pulumi.<stack>.yaml` alone, the same way."""
    return load_stack(stack, root).spec
