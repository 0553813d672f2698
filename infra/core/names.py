"""Physical names that must fit a cloud's limit (data/constraints.yaml, nameLimits)."""

from __future__ import annotations

import hashlib

from infra.core import catalog as cat


def limit(kind: str) -> int:
    return int(cat.load_constraints()["nameLimits"][kind]["max"])


def fit(name: str, kind: str) -> str:
    """`name` when it fits the limit of `kind`, else its start plus a short hash of the whole
    (stable, and distinct for names that share their start)."""
    most = limit(kind)
    if len(name) <= most:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:most - 9].rstrip('-')}-{digest}"
