"""User-facing errors: each names the key path, the bad value, what is allowed and a fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


def suggest(value: object, allowed: Iterable[str]) -> str:
    """Return "; did you mean 'x'?" for the closest allowed value, or ''."""
    choices = [str(a) for a in allowed]
    lowered = {c.lower(): c for c in choices}
    matches = difflib.get_close_matches(str(value).lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean '{lowered[matches[0]]}'?" if matches else ""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the stack spec, at a config key path such as nodeGroups[1].market."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(Exception):
    """The stack spec is invalid. Carries every problem found, so a user fixes them in one go."""

    def __init__(self, problems: list[Problem], source: str = "stack config"):
        self.problems = problems
        self.source = source
        lines = [f"{len(problems)} problem(s) in {source}:"] + [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


class InputError(Exception):
    """A flag, a make variable or an environment variable that cannot be used: exit 2, one line
    naming it, the bad value and the fix."""


def out_error(flag: str, path: object, exc: OSError) -> InputError:
    """OUT=<folder> that cannot be created or written (read-only, a file on the way, no such device)."""
    return InputError(f"{flag}={path}: cannot write there ({exc.strerror or exc}); pass {flag}=<a folder you can "
                      "write>")


# Raised by the catalog reader, which the policy pack owns (policies/gts_policy/catalog.py).
from policies.gts_policy import catalog as _pack  # noqa: E402

CatalogError = _pack.CatalogError
