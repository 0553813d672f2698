"""The bench's order of methods (training/benchorder.py): over a cycle of repeats every method
runs once per repeat, in every position alike and directly after every other method alike: a
neighbour's leftovers (memory the host took back, pages left to write) reach every method alike."""

from __future__ import annotations

from collections import Counter

import pytest

from training import benchorder


@pytest.mark.parametrize("n", range(1, 10))
def test_every_method_follows_every_other_alike_over_a_cycle(n: int) -> None:
    names = [f"m{i}" for i in range(n)]
    rows = [benchorder.order(names, rep) for rep in range(benchorder.cycle(n))]
    assert all(sorted(row) == names for row in rows)  # each repeat runs each method once
    positions = Counter((i, name) for row in rows for i, name in enumerate(row))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    after = Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    assert benchorder.order(names, benchorder.cycle(n)) == rows[0]  # it starts again


def test_a_rotation_is_not_balanced_and_the_order_is_not_a_rotation() -> None:
    """The check above fails on the rotation the bench used before: six methods, each always
    after the same one."""
    names = list("abcdef")
    rotation = [names[r:] + names[:r] for r in range(6)]
    after = Counter(pair for row in rotation for pair in zip(row, row[1:]))
    assert len(after) < 30
    assert benchorder.order(names, 0) == ["a", "b", "f", "c", "e", "d"]
    assert benchorder.order(names, 1) == ["b", "c", "a", "d", "f", "e"]
    # an odd count: a row, then its mirror, so three repeats of three methods are not the rotation
    assert [benchorder.order("abc", r) for r in range(3)] == [list("abc"), list("cba"), list("bca")]
