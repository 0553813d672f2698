"""What the broker asks each cloud before it moves a group, and how it reads a group's launch
failures: one interface, one module per cloud (infra/clouds/<cloud>/stock.py, found through the
cloud's profile). Each module asks the cloud's own API — the names and parameters are cited
there — and answers in a few calls, so a candidate without stock or quota is skipped in
seconds, never launched."""

from __future__ import annotations

import importlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Protocol

from infra.clouds import profile
from infra.model.spec_capacity import Market


# The most one place's stock question may take (the bound per rejected candidate): past it the
# place is skipped as unanswered and the next one asked. Each call's timeout is at most what is left
# of it (Ask.timeout), and no call starts once it is spent.
ASK_BUDGET_S = 5.0


class NoAnswer(TimeoutError):
    """A place's stock API did not answer within the budget."""


@dataclass(frozen=True)
class Ask:
    """Room for a group's nodes at one place."""

    region: str
    zone: str | None
    types: tuple[str, ...]
    market: Market  # how the nodes would be bought there (ask it: market.spot, .on_demand, ...)
    nodes: int  # the group's size to place (its desired size, at least 1)
    vcpus: int  # per node of the first type (quotas are counted in vCPUs on EC2 and ECS)
    type_vcpus: tuple[int, ...] = ()  # per node of each of `types`, in order (empty: `vcpus` for all)
    deadline: float | None = None  # time.monotonic() by which the answer is due (ask_within sets it)

    def vcpus_of(self, itype: str) -> int:
        """vCPUs per node of `itype` (the type a cloud found in stock, not always the first)."""
        if itype in self.types and len(self.type_vcpus) == len(self.types):
            return self.type_vcpus[self.types.index(itype)]
        return self.vcpus

    def timeout(self, most: float) -> float:
        """A call's timeout: `most`, or what is left of the budget when less; NoAnswer once it is spent
        (checked before each call, so an abandoned question makes no further calls)."""
        if self.deadline is None:
            return most
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise NoAnswer("the budget was spent before this call")
        return min(most, left)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str  # what the cloud answered, in one line
    calls: int  # API calls it took
    known: bool = True  # False: the cloud has no stock answer (only offered, within quota): a launch would tell


@dataclass(frozen=True)
class Failure:
    """One launch the group's scaling service could not make for lack of capacity."""

    at: str  # ISO 8601, as the cloud wrote it
    message: str


class StockApi(Protocol):
    def ask(self, ask: Ask) -> Verdict: ...

    def failures(self, group_id: str, since: str | None = None) -> list[Failure]:
        """The group's capacity failures newer than its last successful launch (and than `since`,
        UTC ISO 8601)."""

    def nodes(self, group_id: str) -> tuple[int, int]:
        """(nodes in service, nodes desired) of the group now; it is short when the first is smaller."""


def ask_within(open_api: Callable[[], StockApi], ask: Ask, budget_s: float = ASK_BUDGET_S) -> Verdict:
    """`open_api().ask(ask)`, or NoAnswer once `budget_s` has passed without an answer (a hung or
    slow endpoint, a client retrying). Opening the client counts in the budget. The question carries
    its deadline (Ask.deadline): each cloud's module gives every call at most what is left of it and
    makes no call once it is spent, so an abandoned question ends within one call's timeout, its late
    answer dropped. An error of the question is raised here as it was raised there."""
    done: queue.Queue[tuple[Verdict | None, BaseException | None]] = queue.Queue(maxsize=1)
    timed = replace(ask, deadline=time.monotonic() + budget_s)

    def run() -> None:
        try:
            done.put((open_api().ask(timed), None))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread, raised there)
            done.put((None, exc))

    threading.Thread(target=run, name="gts-stock-ask", daemon=True).start()
    try:
        verdict, error = done.get(timeout=budget_s)
    except queue.Empty:
        raise NoAnswer(f"no answer within {budget_s:g} s") from None
    if error is not None:
        raise error
    assert verdict is not None
    return verdict


def stamp(text: str) -> datetime:
    """An activity's time as a UTC datetime (the clouds write ISO 8601 with Z, some without seconds)."""
    when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def newer(failed: list[Failure], launched: str, since: str | None) -> list[Failure]:
    """The failures after the newest successful launch and after `since`: a capacity failure a later
    launch has outlived, or one from before the group came here, is not a reason to move."""
    floor = [stamp(t) for t in (launched, since or "") if t]
    return [f for f in failed if f.at and all(stamp(f.at) > t for t in floor)]


def stock_api(cloud: str, region: str, **clients: Any) -> StockApi:
    """The cloud's stock module for a region (its own clients or transport when given: tests)."""
    module = importlib.import_module(profile(cloud).stock_module)
    return module.open_api(region, **clients)  # type: ignore[no-any-return]
