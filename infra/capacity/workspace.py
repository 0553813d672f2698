"""The stack the broker changes, behind a small interface: read its config and outputs, set one
config value, run `up`. The stack stays the one truth: a move is a config change
(nodeGroups[i].activeCandidate) followed by `up`, never a resource changed behind Pulumi's back.

`AutomationWorkspace` is Pulumi's Automation API (pulumi.automation: `select_stack`,
`Stack.get_all_config`, `Stack.set_config(key, ConfigValue, path=True)`, `Stack.up`,
`Stack.outputs`). `up` runs with the policy pack (`policy_packs=["policies"]`) and the stack's
pack config for the changed stack (infra/stack/policy_config.py, as `make policy-config` writes it), so a
move is judged by the whole pack as the deploy's `up` is. The Automation API drives the Pulumi CLI, which cannot be installed here, so
this class is type-checked but never run in the tests: they drive the broker with
`RecordingWorkspace`, which keeps the config in memory and records each change and `up`.
With --path, "integers are treated as numbers" (`pulumi config set` reference), so
activeCandidate stays a number in the stack file.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Workspace(Protocol):
    name: str  # the stack's name

    def config(self) -> dict[str, str]:
        """The stack's config as the CLI hands it to a program: `<project>:<key>` -> string."""

    def set_config(self, key: str, value: str) -> None:
        """Set one value by path (`<project>:nodeGroups[0].activeCandidate`)."""

    def up(self, message: str, pack_config: dict[str, Any]) -> None:
        """`up` with the policy pack and this pack config (infra/stack/policy_config.py for_stack)."""

    def outputs(self) -> dict[str, Any]: ...


def uncommitted(root: Path, stack: str) -> str:
    """Why Pulumi.<stack>.yaml is not the repository's committed file ("" when it is): a move made
    on a changed or untracked file would be undone by the next deploy from the repository."""
    name = f"Pulumi.{stack}.yaml"
    try:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", name], cwd=root, capture_output=True,
                                 timeout=30).returncode == 0
        if not tracked:
            return f"{name} is not committed in {root}: commit it first"
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", name], cwd=root, capture_output=True,
                               timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot ask git whether {name} is committed ({exc})"
    return "" if clean else f"{name} differs from the committed one: commit (or discard) the change first"


class AutomationWorkspace:
    """A stack of this project through the Automation API (needs the Pulumi CLI and a backend)."""

    def __init__(self, stack: str, work_dir: Path):
        from pulumi import automation as auto

        self._auto = auto
        self.name, self.work_dir = stack, work_dir
        self.stack = auto.select_stack(stack_name=stack, work_dir=str(work_dir))

    def config(self) -> dict[str, str]:
        return {k: v.value for k, v in self.stack.get_all_config().items()}

    def set_config(self, key: str, value: str) -> None:
        self.stack.set_config(key, self._auto.ConfigValue(value=value), path=True)

    def up(self, message: str, pack_config: dict[str, Any]) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"policy-config-{self.name}-") as fh:
            json.dump(pack_config, fh)
            fh.flush()
            self.stack.up(message=message, on_output=print, policy_packs=[str(self.work_dir / "policies")],
                          policy_pack_configs=[fh.name])

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
    packs: list[dict[str, Any]] = field(default_factory=list)  # the pack config each `up` ran with
    name: str = "dev"

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

    def up(self, message: str, pack_config: dict[str, Any]) -> None:
        self.ups.append(message)
        self.packs.append(pack_config)

    def outputs(self) -> dict[str, Any]:
        return dict(self.stack_outputs)
