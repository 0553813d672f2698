"""The order in which a bench group runs its methods, repeat by repeat (`make bench`:
training/trainer/bench.py, infra/plan/bench.py). Standard library only.

A rotation (A B C D, B C D A, ...) puts every method in every position but keeps each one after
the same neighbour, and a neighbour is not neutral here: on this project's machines a method that
writes into memory the previous one freed seconds before copies at about 3 GB/s, one that writes
into memory the host has taken back (free page reporting) at 0.1-0.2 GB/s
(docs/goodput-and-bench.md). So the order is a Williams square: over `cycle(n)` repeats every
method runs in every position equally often and directly after every other method equally often
(once for an even number of methods; twice for an odd one, whose square is the rows and their
mirrors). A run of fewer repeats than the cycle is balanced only in part."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def _first_row(n: int) -> list[int]:
    """0, 1, n-1, 2, n-2, ...: the differences between neighbours are all distinct mod n (even n)."""
    row, low, high = [0], 1, n - 1
    while len(row) < n:
        row.append(low)
        low += 1
        if len(row) < n:
            row.append(high)
            high -= 1
    return row


def cycle(n: int) -> int:
    """Repeats after which the order is balanced: n for an even count, 2n for an odd one."""
    return n if n % 2 == 0 or n == 1 else 2 * n


def order(names: Sequence[T], rep: int) -> list[T]:
    """The methods in the order repeat `rep` runs them. An odd count alternates a row and its
    mirror (row 0, its mirror, row 1, ...), so that a run shorter than the cycle is not a rotation."""
    n = len(names)
    if n == 0:
        return []
    k = rep % cycle(n)
    if cycle(n) == n:
        row = [(i + k) % n for i in _first_row(n)]
    else:
        row = [(i + k // 2) % n for i in _first_row(n)]
        row = row[::-1] if k % 2 else row
    return [names[i] for i in row]
