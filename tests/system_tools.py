"""Commands from Debian's packages that some tests need (cloud-init, prometheus, promtool).
`make test` installs them with apt-get when it runs as root, as CI does. Where one is missing the
test skips and says why; in CI (CI set) a missing one fails, because CI must never skip them."""

from __future__ import annotations

import os
import shutil

import pytest


def debian_tool(command: str, package: str) -> str:
    found = shutil.which(command)
    if found:
        return found
    reason = (f"{command} is not installed: `make test` installs Debian's {package} package with apt-get when "
              f"it runs as root; install it (apt-get install --no-install-recommends {package}) to run this test")
    if os.environ.get("CI"):
        pytest.fail(reason + " — CI must not skip it")
    pytest.skip(reason)
