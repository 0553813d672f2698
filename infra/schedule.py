"""Cron helpers for scheduled scaling: stack schedules are UTC; some clouds want local time."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone, tzinfo


def recurrence_window(zone: tzinfo = timezone.utc, now: datetime | None = None) -> tuple[datetime, datetime]:
    """First run and end of recurrence for a cloud's scheduled actions: the next full hour, and
    364 days later (Alibaba ESS and Tencent AS want the end within a year). Stacks take them
    from their first run and ignore later changes, so they do not churn on every `pulumi up`."""
    start = (now or datetime.now(zone)).astimezone(zone).replace(minute=0, second=0, microsecond=0)
    start += timedelta(hours=1)
    return start, start + timedelta(days=364)


def cron_in_beijing(cron: str) -> str:
    """A UTC cron expression as Beijing time (UTC+8), which Tencent AS schedules run in.

    Handles the shapes schedules use: one hour value, any minute, day-of-week as *, a value,
    a list or a range (shifted a day when the hour wraps past midnight)."""
    minute, hour, dom, month, dow = cron.split()
    if not hour.isdigit():
        raise ValueError(f"cron {cron!r}: Tencent schedules need a single hour value to convert from UTC")
    shifted = int(hour) + 8
    if shifted < 24 or dow == "*":
        if shifted >= 24 and dom != "*":
            raise ValueError(f"cron {cron!r}: day-of-month cannot be shifted to Beijing time")
        return " ".join((minute, str(shifted % 24), dom, month, dow))
    days: list[int] = []
    for part in dow.split(","):
        lo, _, hi = part.partition("-")
        days += list(range(int(lo), int(hi or lo) + 1))
    return " ".join((minute, str(shifted - 24), dom, month, ",".join(str((d + 1) % 7) for d in sorted(days))))
