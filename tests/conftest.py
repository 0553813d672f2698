from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The date the shipped prices are judged at in tests (infra/prices/age.py): they age with the
# calendar, and their age is the pack's prices-fresh verdict (never an error); pinning it keeps
# the verdicts' text stable. tests/test_hostile_stackfile.py plans with the real date and years on.
os.environ.setdefault("GTS_TODAY", "2026-11-30")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from collections.abc import Iterator  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from tests.training_helpers import MotoServer



def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts a process, plans a whole stack or boots (tests/tiers.py); "
                                       "make test-fast runs the rest")


@pytest.fixture(autouse=True)
def fast_tier_guard() -> Iterator[None]:
    """Under make test-fast, a test that starts a process or plans a stack fails at its teardown
    (tests/tiers.py), even when the refusal was raised in a thread or caught by the test."""
    from tests import tiers

    with tiers.guarded() as refusals:
        yield
    failure = refusals.failure()
    if failure:
        pytest.fail(failure, pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests import tiers

    tiers.mark(items)


# The trainer's arguments the checkpoint tests share: 60 steps, a checkpoint every 20.
TRAIN_ARGS = ["--workload", "tiny", "--steps", "60", "--checkpoint-every", "20", "--log-every", "5"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Run A: 60 uninterrupted steps, checkpoints every 20. (params_sha256, its checkpoint dir)"""
    from tests.training_helpers import launch

    cwd = tmp_path_factory.mktemp("run-a")
    run = launch([*TRAIN_ARGS, "--checkpoint-dir", str(cwd / "ck")], cwd)
    assert run.finish() == 0, run.output[-3000:]
    step, _, digest = run.final()
    assert step == 60
    return digest, cwd / "ck"


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    from tests.training_helpers import MotoServer

    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """Run installs its stop handlers; the test process gets its own back."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
