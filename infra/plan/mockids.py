"""Stable mock ids for the mock engine's computed outputs (infra/clouds/<cloud>/mocks.py)."""

from __future__ import annotations

import hashlib


def mock_id(prefix: str, name: str, length: int = 8) -> str:
    """`prefix` and `length` hex characters derived from the resource's name: the same every run."""
    return prefix + hashlib.sha256(name.encode()).hexdigest()[:length]
