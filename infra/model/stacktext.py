"""A stack file's text the way the Pulumi CLI hands it to the program: project-namespaced keys,
structured values passed as JSON strings, `secure:` values kept secret, YAML that refuses a key
given twice. Reading only: no spec, no validation (infra/stack/stackfile.py reads a stack's spec with
these at the program's and the commands' edge). Nothing here runs at import time; the project
root is found when a function asks for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra import clouds
from infra.core import yamlread
from infra.core.errors import Problem
from infra.model import spec_patterns

SECRET_MASK = spec_patterns.SECRET_MASK
# Keys whose values the program receives as plain strings; the others are JSON.
SCALAR_KEYS = ("env",)


class StackFileError(Exception):
    """The stack file cannot be read as Pulumi would read it."""


# Pulumi's own rule for a stack name (pulumi/pulumi sdk/go/common/tokens/stack_name.go,
# ParseStackName): not empty, at most 100 characters of `[A-Za-z0-9_.-]`. Checked before the name
# reaches a path, a file name or a command.
STACK_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def check_stack_name(stack: str) -> str:
    """`stack` when Pulumi would accept it as a stack name; a StackFileError naming the rule."""
    if STACK_NAME.fullmatch(stack):
        return stack
    bad = next((ch for ch in stack if not re.fullmatch(r"[A-Za-z0-9_.-]", ch)), "")
    why = ("is empty" if not stack else "is longer than 100 characters" if len(stack) > 100
           else f"has {bad!r} at position {stack.index(bad)}")
    raise StackFileError(f"stack name {stack!r} {why}: a Pulumi stack name is 1-100 letters, digits, hyphens, "
                         "underscores or periods (pass STACK=<name of a Pulumi.<name>.yaml here>)")


@dataclass(frozen=True)
class StackConfig:
    project: str
    stack: str
    values: dict[str, str]  # full key -> string as the program receives it
    secret_keys: list[str] = field(default_factory=list)


def project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: cwd) holding Pulumi.yaml, as the CLI
    finds it; this checkout when there is none."""
    here = (start or Path.cwd()).absolute()
    for folder in (here, *here.parents):
        if (folder / "Pulumi.yaml").exists():
            return folder
    return Path(__file__).resolve().parents[2]


def project_name(root: Path | None = None) -> str:
    data = yaml.safe_load(((root or project_root()) / "Pulumi.yaml").read_text(encoding="utf-8"))
    return str(data["name"])


def available_stacks(root: Path | None = None) -> list[str]:
    return sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (root or project_root()).glob("Pulumi.*.yaml")
                  if p.is_file())




def _has_secret(value: Any) -> bool:
    if isinstance(value, dict):
        return set(value) == {"secure"} or any(_has_secret(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_secret(v) for v in value)
    return False


def _mask(value: Any) -> Any:
    """Nested `secure:` values (`pulumi config set --secret --path a.b`) as the mask: the
    offline plan cannot decrypt them and needs no plaintext."""
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return SECRET_MASK
        return {k: _mask(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def read_stack_file(path: Path, project: str) -> StackConfig:
    """Turn `Pulumi.<stack>.yaml` into the config map the Pulumi CLI hands the program."""
    return read_stack_text(read_text(path), path.name, project)


def read_text(path: Path) -> str:
    """A stack file's (or teams.yaml's) text, or a StackFileError naming it: only a regular file
    is opened (a directory, a FIFO or /dev/zero is refused by its kind, never read), at most
    yamlread.MAX_BYTES of it, and UTF-8 (as the Pulumi CLI reads it)."""
    try:
        info = path.stat()
    except OSError as exc:
        dangling = path.is_symlink()
        raise StackFileError(f"{path.name}: " + ("is a link to a missing file" if dangling else
                             f"cannot be read ({exc.strerror})") + "; point it at a stack file or remove it") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise StackFileError(f"{path.name} is {kind}; a stack file is a YAML file (remove or rename it)")
    if info.st_size > yamlread.MAX_BYTES:
        raise StackFileError(f"{path.name} is larger than {yamlread.MAX_BYTES // 1024} KiB; a stack file is a few KB")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise StackFileError(f"{path.name}: cannot be read ({exc.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise StackFileError(f"{path.name}, line {line}: byte 0x{data[exc.start]:02x} is not UTF-8; save the file as "
                             "UTF-8 (the Pulumi CLI reads it so)") from None


def load_yaml(text: str, name: str) -> Any:
    """A stack file's YAML as the Pulumi CLI reads it, bounded in work, refusing a key given
    twice (infra/core/yamlread.py; teams.yaml is read the same way): `scaling: {max: 50, max: 2}`
    would otherwise plan with the last."""
    try:
        return yamlread.load(text)
    except yamlread.YamlError as exc:
        at = f", line {exc.line}:" if exc.line is not None else "" if str(exc).startswith("is ") else ":"
        raise StackFileError(f"{name}{at} {exc}") from None


# Provider settings that are credentials: in a stack file only as `secure:` values.
CREDENTIAL_KEYS = frozenset({
    "aws:accessKey", "aws:secretKey", "aws:token",
    "alicloud:accessKey", "alicloud:secretKey", "alicloud:securityToken",
    "tencentcloud:secretId", "tencentcloud:secretKey", "tencentcloud:securityToken",
})
URL_PASSWORD = spec_patterns.URL_PASSWORD


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(key path, string) for every plain string in a config value; `secure:` values are skipped."""
    if isinstance(value, dict):
        if set(value) == {"secure"}:
            return
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def secrets_in_clear(config: Mapping[str, Any], project: str) -> list[str]:
    """What a stack file holds in clear that must be encrypted: provider credentials, and
    passwords in URLs (which would reach the nodes' user data in clear)."""
    found = []
    for key, value in config.items():
        full = key if ":" in str(key) else f"{project}:{key}"
        if full in CREDENTIAL_KEYS and not _has_secret(value):
            found.append(f"{full} is a credential in clear; remove the line and run `pulumi config set --secret "
                         f"{full} <value>` (or leave it out and use the provider's environment or profile)")
            continue
        for where, text in _strings(value, full):
            if URL_PASSWORD.search(text):
                found.append(f"{where} holds a URL with a password in clear; remove the password from the URL, "
                             "or store the value with `pulumi config set --secret`")
    return found


def read_stack_text(text: str, name: str, project: str) -> StackConfig:
    """The same for a stack file's text (`name` is its file name: Pulumi.<stack>.yaml). A plan
    reads each stack file several times (the stack, the team registry's checks, the drift of
    generated stacks): the text is parsed once, and each caller gets its own copy."""
    cfg = _read_stack_text(text, name, project)
    return dataclasses.replace(cfg, values=dict(cfg.values), secret_keys=list(cfg.secret_keys))


@functools.lru_cache(maxsize=64)
def _read_stack_text(text: str, name: str, project: str) -> StackConfig:
    stack = name[len("Pulumi."):-len(".yaml")]
    data = load_yaml(text, name) or {}
    if not isinstance(data, dict) or not isinstance(data.get("config", {}), dict):
        raise StackFileError(f"{name}: expected a mapping with a 'config:' mapping")
    odd = next((k for k in (data.get("config") or {}) if not isinstance(k, str)), "")
    if odd != "":
        raise StackFileError(f"{name}: config key {json.dumps(odd)} is not text; config keys are names such as "
                             f"{project}:budget")
    clear = secrets_in_clear(data.get("config") or {}, project)
    if clear:
        raise StackFileError(f"{name}: " + "; ".join(clear))
    values: dict[str, str] = {}
    secrets: list[str] = []
    for key, value in (data.get("config") or {}).items():
        full = key if ":" in key else f"{project}:{key}"
        if _has_secret(value):
            # Encrypted with the stack's key; the CLI marks the whole key secret.
            secrets.append(full)
        masked = _mask(value)
        values[full] = masked if isinstance(masked, str) else json.dumps(masked)
    return StackConfig(project, stack, values, secrets)


def decode(values: Mapping[str, str]) -> dict[str, Any]:
    """Config strings (as the engine hands them to the program) to spec values: structured
    keys are JSON, scalar keys stay strings; unknown keys pass through for the spec to name."""
    raw: dict[str, Any] = {}
    for key, text in values.items():
        if key in SCALAR_KEYS:
            raw[key] = text
            continue
        try:
            raw[key] = json.loads(text)
        except json.JSONDecodeError:
            raw[key] = text  # pydantic then says which type it expected
    return raw


# Config namespaces that are not the project's and are expected in a stack file.
PROVIDER_NAMESPACES = (*(p.provider for p in clouds.profiles()), "kubernetes", "pulumi", "docker-build")


def stray_keys(values: Mapping[str, str], project: str) -> list[Problem]:
    """Keys under a namespace that is neither the project's nor a provider's: a misspelled
    project name hides the value from the program (Pulumi passes it to nobody)."""
    import difflib

    problems = []
    for key in values:
        namespace, _, name = key.partition(":")
        if namespace in (project, *PROVIDER_NAMESPACES):
            continue
        close = difflib.get_close_matches(namespace, [project], n=1, cutoff=0.6)
        hint = f"; did you mean '{project}:{name}'?" if close else f"; this project's keys are '{project}:<key>'"
        problems.append(Problem(key, f"is under '{namespace}', not this project's '{project}', so the program never "
                                     f"sees it{hint}"))
    return problems


GENERATED = "# GENERATED by `make teams`"  # the first line of a team's generated stack file


def is_generated(path: Path) -> bool:
    try:
        return read_text(path).startswith(GENERATED)
    except StackFileError:
        return False
