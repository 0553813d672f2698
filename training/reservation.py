"""The end of a reservation the nodes run in (RESERVATION_END, RESERVATION_NOTICE_S in the trainer
contract; the stack sets them for capacity-block, capacity-reservation and elasticity-assurance
markets, infra/capacity/reservations.py). The cloud starts taking the nodes back
RESERVATION_NOTICE_S before the end (an EC2 Capacity Block: 30 minutes); the trainer stops with a
checkpoint early enough for it to be in the bucket by then: at end - notice - the time an upload
may take (--upload-deadline-s). The loop asks `due()` once per step, like a stop signal
(training/ckpt/run_control.py StopFlag.poll); `CLOCK` is the only clock it reads, so a test can stand
a fake one in for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone

from training import contract

CLOCK: Callable[[], float] = time.time
REASON = "RESERVATION_END"


def parse_end(value: str) -> float | None:
    """Unix time of an ISO 8601 instant with its offset ('' = none); ValueError names the variable."""
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{contract.RESERVATION_END.name}={value!r}: an ISO 8601 time with its offset, e.g. "
                         "2026-12-24T08:00:00Z") from None
    if when.tzinfo is None:
        raise ValueError(f"{contract.RESERVATION_END.name}={value!r} has no offset: write it in UTC, e.g. "
                         f"{value}Z")
    return when.astimezone(timezone.utc).timestamp()


class Deadline:
    """When the run must have stopped with a durable checkpoint (None: no reservation)."""

    def __init__(self, end: float | None, notice_s: float, upload_s: float):
        self.stop_at = None if end is None else end - notice_s - upload_s

    @classmethod
    def from_env(cls, env: dict[str, str], upload_s: float) -> Deadline:
        notice = env.get(contract.RESERVATION_NOTICE_S.name) or "0"
        return cls(parse_end(env.get(contract.RESERVATION_END.name, "")), float(notice), upload_s)

    def due(self) -> bool:
        return self.stop_at is not None and CLOCK() >= self.stop_at
