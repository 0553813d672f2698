"""The one pkg_resources function parliament 1.6.4 calls (resource_filename, at import), for
setuptools >= 81, which no longer ships pkg_resources. On the module path only for the
parliament subprocess of tests/test_least_privilege.py."""

from __future__ import annotations

from importlib.resources import files


def resource_filename(package: str, name: str) -> str:
    return str(files(package) / name)
