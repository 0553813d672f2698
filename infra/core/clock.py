"""The one date the plan is judged at: GTS_TODAY (YYYY-MM-DD) when set, else today. The prices'
age (infra/prices/age.py) and the reservation windows (infra/capacity/reservations.py) read it,
so a pinned plan is reproducible and the tests are not at the mercy of the calendar."""

from __future__ import annotations

import datetime
import os
import re

from infra.core.errors import InputError


def judged_on() -> datetime.date:
    """The date prices are judged at: GTS_TODAY (YYYY-MM-DD, for a reproducible plan of an old
    change, and the tests) or today."""
    pinned = os.environ.get("GTS_TODAY")
    if not pinned:
        return datetime.date.today()
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", pinned):
            raise ValueError("not YYYY-MM-DD")
        return datetime.date.fromisoformat(pinned)
    except ValueError as exc:
        raise InputError(f"GTS_TODAY={pinned!r} is not a date ({exc}); write YYYY-MM-DD (e.g. 2026-11-30), or unset "
                         "it for today") from None
