"""A stack file's problems in its own spelling: pydantic's shape and range errors as key paths
(`nodeGroups[1].instanceType`) with the bad value, what is allowed and a close match, and the
region check every reader of a region shares (the stack spec, the team registry)."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from infra.core import catalog as cat
from infra.core.errors import Problem, suggest
from infra.model.spec import StackSpec
from infra.model.spec_patterns import PATTERN_HELP, URL_PASSWORD


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("function-after") or part in ("str", "int", "[key]"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _fields_at(loc: tuple[int | str, ...], root: type[BaseModel] = StackSpec) -> list[str]:
    """Aliases of the model fields allowed where an unknown key was found."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return []
        model = _model_of(field.annotation)
    return [f.alias or n for n, f in model.model_fields.items()] if model else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found:
            return found
    return None


def _problem(err: Any, root: type[BaseModel] = StackSpec) -> Problem:
    loc = tuple(err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _fields_at(loc, root)
        return Problem(_path(loc), f"unknown key{suggest(loc[-1], allowed)} "
                                   f"Allowed here: {', '.join(allowed)}.")
    if kind == "missing":
        return Problem(_path(loc), "is required but missing; add it to the stack config")
    if kind in ("literal_error", "enum"):
        raw = str(err.get("ctx", {}).get("expected", ""))
        expected = re.findall(r"'([^']+)'", raw) or [raw]  # a Literal of numbers has no quotes
        return Problem(_path(loc), f"{value!r} is not allowed; use one of {', '.join(expected)}"
                                   f"{suggest(value, expected)}")
    msg = str(err["msg"]).removeprefix("Value error, ")
    if kind == "string_type" and isinstance(value, int) and loc[-1] == "appId":
        return Problem(_path(loc), f"{value} is a number to YAML; write the APPID quoted: appId: \"{value}\"")
    if kind == "ip_v4_network" and isinstance(value, str):
        import ipaddress

        try:
            network = ipaddress.ip_network(value, strict=False)
        except ValueError:
            network = None
        if isinstance(network, ipaddress.IPv6Network):
            return Problem(_path(loc), f"{value!r} is an IPv6 network; this key takes an IPv4 CIDR such as 10.0.0.0/16")
        if network is not None and "/" in value and str(network) != value:
            return Problem(_path(loc), f"{value!r} has host bits set; the network is {network} (write that)")
    if kind in ("int_type", "int_from_float", "int_parsing", "float_type") and isinstance(value, bool):
        return Problem(_path(loc), f"{str(value).lower()} is a YAML boolean, not a number; write a "
                                   f"{'number' if kind == 'float_type' else 'whole number'}")
    if kind in ("int_type", "float_type") and isinstance(value, str):
        return Problem(_path(loc), f"{value!r} is text, not a number; {number_fix(value)}")
    if kind == "finite_number":
        return Problem(_path(loc), f"{value} is not a finite number; write the amount (a number such as 100)")
    if kind == "string_pattern_mismatch":
        pattern = str(err.get("ctx", {}).get("pattern", ""))
        msg = f"is not a valid value; {PATTERN_HELP.get(pattern, msg)}"
    shown = "" if isinstance(value, (dict, list)) or value is None else f"{value!r}: "
    if isinstance(value, str) and URL_PASSWORD.search(value):  # a decrypted secret: never echoed
        shown = "(a URL with a password, not shown): "
    return Problem(_path(loc), f"{shown}{msg}")


def number_fix(text: str) -> str:
    """What to write instead of a number the Pulumi CLI reads as text (its YAML is 1.2: no base-60
    `50:00`, and `1_000` is not a number in YAML 1.2's core schema) or a quoted number."""
    plain = text.strip()
    if re.fullmatch(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9]*)?", plain):
        head, *rest = plain.replace("_", "").split(":")
        total = float(head.lstrip("+-") or 0)
        for part in rest:
            total = total * 60 + float(part)
        shown = f"{'-' if plain.startswith('-') else ''}{total:g}"
        return f"YAML 1.2 (the Pulumi CLI's) has no base-60 numbers: write {shown} if that is what it means"
    if "_" in plain and re.fullmatch(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?", plain):
        return f"write it without underscores ({plain.replace('_', '')}): YAML readers disagree on 1_000"
    try:
        number = float(plain)
    except ValueError:
        return "write a number, unquoted"
    if not math.isfinite(number):
        return "write a finite amount (a number such as 100)"
    return f"write it unquoted ({plain}) so YAML reads a number"


def problems_of(exc: ValidationError, root: type[BaseModel]) -> list[Problem]:
    """pydantic's errors for a model read from a file as key paths in the file's own spelling."""
    return [_problem(e, root) for e in exc.errors()]


def check_region(cloud: str, region: str, path: str) -> list[Problem]:
    regions = cat.load_regions()[cloud]
    if region in regions:
        return []
    return [Problem(path, f"{region!r} is not a region of {cat.CLOUD_NAMES[cloud]} known here"
                          f"{suggest(region, regions)} Known: {', '.join(regions)} "
                          f"(add others to infra/data/regions.yaml).")]
