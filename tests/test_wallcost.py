"""A checkpoint's wall cost: its blocked time plus the extra time of the steps its background
write slowed, against the usual step time (training/wallcost.py)."""

from __future__ import annotations

import pytest

from training.wallcost import WallCost


def test_the_cost_is_blocked_plus_the_slower_steps_while_writing() -> None:
    wall = WallCost(smoothing=0.5)
    for _ in range(5):
        assert wall.step(1.0, writing=False) is None  # no checkpoint yet: the usual step is 1 s
    assert wall.checkpoint(0.25) is None
    assert wall.step(1.5, writing=True) is None
    assert wall.step(1.25, writing=True) is None
    assert wall.step(0.75, writing=True) is None  # a faster step never gives time back
    assert wall.step(1.0, writing=False) == pytest.approx(0.25 + 0.5 + 0.25)
    assert wall.step(1.0, writing=False) is None  # reported once


def test_an_inline_checkpoint_costs_what_it_blocked() -> None:
    wall = WallCost()
    wall.step(0.1, writing=False)
    wall.checkpoint(2.0)
    assert wall.step(0.1, writing=False) == pytest.approx(2.0)


def test_a_checkpoint_started_while_the_last_is_written_closes_the_last() -> None:
    wall = WallCost(smoothing=1.0)
    wall.step(1.0, writing=False)
    wall.checkpoint(0.5)
    wall.step(2.0, writing=True)
    assert wall.checkpoint(0.5) == pytest.approx(0.5 + 1.0)
