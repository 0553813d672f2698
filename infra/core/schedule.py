"""Cron helpers for scheduled scaling: stack schedules are UTC; some clouds want local time."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone, tzinfo


def recurrence_window(zone: tzinfo = timezone.utc, now: datetime | None = None) -> tuple[datetime, datetime]:
    """First run and end of recurrence for a cloud's scheduled actions.

    Neither cloud has a recurrence without an end: Alibaba ESS needs RecurrenceEndTime with the
    recurrence, at most 365 days after the task is created (pulumi_alicloud ess/scheduled_task.py),
    Tencent AS needs end_time with it (terraform-provider-tencentcloud as/resource_tc_as_schedule.go:
    "end_time and recurrence must be specified at the same time"). So the end is the first day of
    the month eleven months on: the same all month (no churn), at most 334 days after creation,
    and it moves on with the first `pulumi up` of each new month, which replaces the task (see
    `RENEW`). The first run is the next full hour; the clouds take it only at creation."""
    moment = (now or datetime.now(zone)).astimezone(zone)
    start = moment.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    months = moment.year * 12 + moment.month - 1 + 11
    end = moment.replace(year=months // 12, month=months % 12 + 1, day=1, hour=0, minute=0, second=0, microsecond=0)
    return start, end


# Resource options of a renewed scheduled action: a new end replaces the task (a modified task
# may not reach beyond 365 days of its creation), old one first (names are unique per group).
RENEW_REPLACE = ["recurrenceEndTime", "endTime"]


def cron_in_beijing(cron: str) -> str:
    """A UTC cron expression as Beijing time (UTC+8), which Tencent AS schedules run in.

    Handles the shapes schedules use: one hour value, any minute, day-of-week as *, a value,
    a list or a range (shifted a day when the hour wraps past midnight)."""
    minute, hour, dom, month, dow = cron.split()
    if any(c.isalpha() for c in dow + month):
        raise ValueError(f"cron {cron!r}: write days and months as numbers (MON-FRI is 1-5, SUN is 0): the stack "
                         "shifts them a day where UTC and Beijing time fall on different dates")
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
