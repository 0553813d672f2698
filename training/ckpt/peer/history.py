"""Which peer copies belong to the run's history (issue 46's known gap, closed).

Every world that restores names a new generation, `<n>-<step restored>`, and sends its copies under
it; each store of the world records the restore (DELETE /v1/keep/<world>/<step>/<generation>/<chosen>:
the generation, the step, and the generation of the peer copy it took, or `durable`) besides
forgetting the copies it no longer needs. A store cut off from the run when that happened still
holds copies of the history the run left, and lists them when its node comes back. So a restore
merges the records of every store it lists and drops each copy that a later restore left behind:
one of a later step than that restore's, or of its step but another generation than the copy it
took. A copy only the cut-off store holds is then never chosen over the run's own history, and
never mixed with it.

<n> orders generations: one more than any this world's stores have seen (a record or a copy),
and at least the Unix time of rank 0's clock, so that a restore after a store's loss still
orders after the copies it leaves (a clock behind another node's cannot put it first). A
generation more than AHEAD_S past the reader's clock is no generation: its copies and records
are not used.

Records are merged across every rank's listing when the copies are picked (a collective: rank 0
picks them, and a store that rank 0 alone could not list still counts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

GENERATION = re.compile(r"^(\d{1,12})-(\d{1,12})$")
DURABLE = "durable"  # a restore from the disk or the bucket: no peer copy taken
MAX_RECORDS = 256  # a store keeps the newest this many restores
AHEAD_S = 7 * 86400  # how far past this node's clock a generation may be (rank 0's clock, and restores within a second)


def order(generation: str) -> tuple[int, int]:
    """(n, step) of `<n>-<step>`; (-1, -1) for what is not one (never orders after a real one)."""
    match = GENERATION.match(str(generation))
    return (int(match.group(1)), int(match.group(2))) if match else (-1, -1)


def valid_record(record: Any) -> bool:
    """[generation, step, chosen] as a store lists it."""
    return (isinstance(record, list) and len(record) == 3 and GENERATION.match(str(record[0])) is not None
            and isinstance(record[1], int) and not isinstance(record[1], bool) and record[1] >= 0
            and (record[2] == DURABLE or GENERATION.match(str(record[2])) is not None))


def left_behind(step: int, generation: str, records: Iterable[list[Any]]) -> bool:
    """A copy of `step` sent under `generation` is of a history a later restore left: a restore
    whose generation orders after it went back to an earlier step, or to this step and took
    another generation's copy (or the disk's)."""
    mine = order(generation)
    return any(order(later) > mine and (at < step or (at == step and chosen != generation))
               for later, at, chosen in records)


def plausible(generation: str, now: float) -> bool:
    """A generation no world can have made yet (AHEAD_S past `now`) is not one: a store that lists
    it (a clock set years ahead, or worse) must not order every later restore before it."""
    return order(generation)[0] <= now + AHEAD_S


def current(held: list[tuple[str, list[Any]]], records: Iterable[list[Any]],
            now: float) -> list[tuple[str, list[Any]]]:
    """The copies in `held` ((store, [world, rank, step, kind, digest, size, generation])) that no
    restore in `records` (every listed store's, merged) left behind, and whose generation is
    `plausible`."""
    merged = [list(r) for r in {tuple(r) for r in records} if plausible(str(r[0]), now)]
    return [(store, entry) for store, entry in held
            if plausible(str(entry[6]), now) and not left_behind(int(entry[2]), str(entry[6]), merged)]


def next_generation(step: int, seen: Iterable[str], now: float) -> str:
    """The generation of a world that restored `step`: after every plausible one in `seen`, and not
    before `now`."""
    newest = max((order(g)[0] for g in seen if plausible(g, now)), default=-1)
    return f"{max(int(now), newest + 1)}-{step}"
