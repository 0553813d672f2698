"""The stack the broker changes, behind a small interface: read its config and outputs, set one
config value, run `up`. The stack stays the one truth: a move is a config change
(nodeGroups[i].activeCandidate) followed by `up`, never a resource changed behind Pulumi's back.

`AutomationWorkspace` is Pulumi's Automation API (pulumi.automation: `select_stack`,
`Stack.get_all_config`, `Stack.set_config(key, ConfigValue, path=True)`, `Stack.up`,
`Stack.outputs`). The Automation API drives the Pulumi CLI, which cannot be installed here, so
this class is type-checked but never run in the tests: they drive the broker with
`RecordingWorkspace`, which keeps the config in memory and records each change and `up`.
With --path, "integers are treated as numbers" (`pulumi config set` reference), so
activeCandidate stays a number in the stack file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Workspace(Protocol):
    def config(self) -> dict[str, str]:
        """The stack's config as the CLI hands it to a program: `<project>:<key>` -> string."""

    def set_config(self, key: str, value: str) -> None:
        """Set one value by path (`<project>:nodeGroups[0].activeCandidate`)."""

    def up(self, message: str) -> None: ...

    def outputs(self) -> dict[str, Any]: ...


class AutomationWorkspace:
    """A stack of this project through the Automation API (needs the Pulumi CLI and a backend)."""

    def __init__(self, stack: str, work_dir: Path):
        from pulumi import automation as auto

        self._auto = auto
        self.stack = auto.select_stack(stack_name=stack, work_dir=str(work_dir))

    def config(self) -> dict[str, str]:
        return {k: v.value for k, v in self.stack.get_all_config().items()}

    def set_config(self, key: str, value: str) -> None:
        self.stack.set_config(key, self._auto.ConfigValue(value=value), path=True)

    def up(self, message: str) -> None:
        self.stack.up(message=message, on_output=print)

    def outputs(self) -> dict[str, Any]:
        return {k: v.value for k, v in self.stack.outputs().items()}


@dataclass
class RecordingWorkspace:
    """A stack in memory: the config map (structured values as JSON, as the CLI hands them),
    the outputs the tests give, and a record of every change and `up`."""

    values: dict[str, str]
    stack_outputs: dict[str, Any] = field(default_factory=dict)
    changes: list[tuple[str, str]] = field(default_factory=list)
    ups: list[str] = field(default_factory=list)

    def config(self) -> dict[str, str]:
        return dict(self.values)

    def set_config(self, key: str, value: str) -> None:
        """Path keys into structured values, as `pulumi config set --path` does (a number stays one)."""
        self.changes.append((key, value))
        top, _, rest = key.partition("[")
        data = json.loads(self.values[top])
        target, parts = data, rest.replace("].", "[").rstrip("]").split("[")
        *steps, leaf = [int(p) if p.isdigit() else p for p in parts if p]
        for step in steps:
            target = target[step]
        target[leaf] = int(value) if value.lstrip("-").isdigit() else value
        self.values[top] = json.dumps(data)

    def up(self, message: str) -> None:
        self.ups.append(message)

    def outputs(self) -> dict[str, Any]:
        return dict(self.stack_outputs)
