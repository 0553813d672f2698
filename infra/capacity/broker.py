"""The capacity broker: for each node group with candidates, read its launch failures (the
scaling service's activities, infra/clouds/<cloud>/stock.py) and the run's progress (its newest
committed checkpoint in the bucket); when the group cannot get capacity where it is, ask each
other place in order for stock (a few calls each, never a launch), and move the group to the
first that has it: copy the newest committed checkpoint (and the dataset, if absent) to that
cloud's bucket, verified; set nodeGroups[i].activeCandidate in the stack's config and run `up`
(infra/capacity/workspace.py); record the move in the destination bucket
(records/capacity/<group>/). A failed `up` sets the config back, records the failed attempt and
stops the watch (MoveFailed); each watch first checks that the stack's outputs show the group's
fleet at its active place. One watch at a time: a lease in the declared bucket
(records/capacity-lock/run.lease, training/ckpt/lease.py's conditional write). It never moves while a
checkpoint is being written, and moves back
to the declared place only when asked to (--move-back) and the declared place has stock again.
docs/capacity.md says how to run it (CI schedule, cron, CronJob)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from infra.buckets import Bucket, bucket
from infra.capacity.places import Place, places
from infra.capacity.pricing import pack_config, types_at
from infra.capacity.reservations import notice_s, open_now
from infra.capacity.stock import ASK_BUDGET_S, Ask, Failure, StockApi, Verdict, ask_within, stock_api
from infra.capacity.transfer import Copied, copy_dataset, copy_step, progress
from infra.capacity.workspace import Workspace
from infra.checks.validation import parse_values
from infra.model.spec import NodeGroup, StackSpec
from infra.model.stacktext import project_name
from infra.resolve.groups import Stack
from infra.stack.policy_config import base_config, for_stack
from policies.gts_policy.rules_capacity import candidates_capped
from training.ckpt.lease import Lease, LeaseHeld
from training.ckpt.storage import Location, location

RECORDS = "records/capacity"
LOCK = "records/capacity-lock"  # its run.lease: one watch of the stack at a time
# An incomplete step whose newest object is older than this was abandoned (a crash mid-upload). Above
# the trainer's own exit deadline (--upload-deadline-s, 90 s) and any one file's upload time.
STALE_AFTER_S = 900.0
LOCK_TTL_S = 1800.0  # a watch's lock not renewed for this long is taken over (a broker that died mid-move)


class MoveFailed(RuntimeError):
    """`up` failed during a move: the config was set back, the attempt recorded (the message says all)."""


class Busy(RuntimeError):
    """Another watch of this stack holds the lock (the message names it)."""


@dataclass
class Decision:
    """What the broker did for one group in one watch."""

    group: str
    action: str  # stay | wait | move | mismatch
    reason: str
    at: int  # the place it runs at afterwards
    skipped: list[dict[str, object]] = field(default_factory=list)  # places without stock: index, why, calls
    copied: Copied | None = None


def capped(stack: Stack) -> dict[tuple[str, int], str]:
    """(group, place) -> why the policy pack's capacity-candidates-capped rule refuses it, with the
    settings of the stack's environment (policies/<env>.json); the rule's own defaults otherwise."""
    entry = base_config(stack.spec.env, stack.spec.env).get("capacity-candidates-capped", {})
    settings = dict(entry) if isinstance(entry, dict) else {"enforcementLevel": entry}
    if settings.pop("enforcementLevel", "mandatory") in ("disabled", "advisory"):
        return {}
    out: dict[tuple[str, int], str] = {}
    for resource, message in candidates_capped([], {**settings, "capacityPlaces": pack_config(stack)}):
        group, _, rest = resource.partition(" capacity[")
        out.setdefault((group, int(rest.rstrip("]")) + 1), f"refused by the policy pack: {message}")
    return out


def _when(text: str) -> datetime:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


class Broker:
    def __init__(self, workspace: Workspace, stock: Callable[[str, str], StockApi] = stock_api,
                 storage: Callable[[Bucket, str], Location] = lambda where, url: location(url), move_back: bool = False,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc), stale_after_s: float = STALE_AFTER_S,
                 ask_budget_s: float = ASK_BUDGET_S):
        """`stock(cloud, region)`: the cloud's stock API; `storage(bucket, url)`: a URL in one of the
        stack's buckets, opened with the operator's access to it (infra/capacity/__main__.py builds both);
        `stale_after_s`: an incomplete step whose newest object is older is abandoned, not being written;
        `ask_budget_s`: the most one place's stock question may take before it is skipped unanswered."""
        self.workspace, self.stock, self.storage, self.move_back, self.now = workspace, stock, storage, move_back, now
        self.stale_after_s, self.ask_budget_s = stale_after_s, ask_budget_s
        self.project = project_name()
        self._apis: dict[tuple[str, str], StockApi] = {}
        self.capped: dict[tuple[str, int], str] = {}

    def api(self, cloud: str, region: str) -> StockApi:
        if (cloud, region) not in self._apis:
            self._apis[(cloud, region)] = self.stock(cloud, region)
        return self._apis[(cloud, region)]

    def once(self) -> list[Decision]:
        """One watch over every group with candidates."""
        stack = parse_values(self.workspace.config(), self.project, "the stack's config")
        spec = stack.declared or stack.spec
        outputs = self.workspace.outputs()
        self.capped = capped(stack)
        groups = [(i, g) for i, g in enumerate(spec.node_groups) if g.capacity]
        if not groups:
            return []
        lease = self._lock(spec, groups[0][1])
        try:
            return [self._group(spec, i, g, outputs) for i, g in groups]
        finally:
            lease.release()

    def _lock(self, spec: StackSpec, first: NodeGroup) -> Lease:
        """This watch's lock: a lease object in the declared place's bucket, taken by a conditional
        create (training/ckpt/lease.py), renewed while the watch runs; Busy when another watch holds it."""
        where = bucket(spec, places(spec, first)[0].cloud)
        lease = Lease(self.storage(where, f"{where.url}{LOCK}"),
                      f"capacity broker pid {os.getpid()} on {socket.gethostname()} ({id(self):x})", ttl_s=LOCK_TTL_S)
        try:
            lease.acquire()
        except LeaseHeld as exc:
            raise Busy(f"another capacity watch of this stack is running ({exc}); this one moved nothing") from None
        lease.keep(lambda why: None)  # a lost lock shows in the next watch's acquire
        return lease

    def _group(self, spec: StackSpec, index: int, group: NodeGroup, outputs: Mapping[str, object]) -> Decision:
        every = places(spec, group)
        here = every[group.active_candidate]
        elsewhere = self._mismatch(group.name, here, outputs)
        if elsewhere:
            return Decision(group.name, "mismatch", f"activeCandidate {here.index} puts it at {here.label}, but the "
                                                    f"stack's outputs show its fleet on {elsewhere}: the last `up` did "
                                                    "not finish; run `pulumi up` (or set activeCandidate back) before "
                                                    "the broker moves it again", here.index)
        arrived, arrival_step = self._arrived(spec, group.name, here)
        failures, running = self._failures(here, group.name, outputs, arrived)
        if failures:
            order = every[here.index + 1:] + [p for p in every[:here.index]]
            reason = f"{len(failures)} launch failure(s) at {here.label}: {failures[0].message[:160]}"
        elif self.move_back and here.index != 0:
            order, reason = [every[0]], "the declared place may have capacity again (--move-back)"
        else:
            return Decision(group.name, "stay", f"no launch failure at {here.label}", here.index)
        source = self.storage(bucket(spec, here.cloud), bucket(spec, here.cloud).checkpoint_url(group.name))
        now = progress(source, self.now(), self.stale_after_s, writers=running != 0)
        if now.writing is not None:
            return Decision(group.name, "wait", f"{reason}; step {now.writing} is being written: moving after it "
                                                "is committed", here.index)
        if not failures and arrived is not None and (now.committed or -1) <= (arrival_step or -1):
            return Decision(group.name, "stay", f"{reason}: not yet, no step committed at {here.label} since it "
                                                f"arrived (step {arrival_step}): its nodes may still be starting",
                            here.index)
        if now.abandoned:
            reason += (f"; step(s) {', '.join(map(str, now.abandoned))} abandoned half-written (no node running, or "
                       f"nothing written for {self.stale_after_s:g} s): moving from step {now.committed}")
        decision = Decision(group.name, "stay", f"{reason}; no other place has stock", here.index)
        for place in order:
            verdict = self._verdict(spec, group, place, decision, known=not failures)
            if verdict is None:
                continue
            decision.copied = self._copy(spec, group.name, here, place, now.committed)
            decision.reason = f"{reason}; {place.label}: {verdict.why}"
            self._move(spec, index, group.name, here, place, decision, now.committed)
            decision.action, decision.at = "move", place.index
            break
        return decision

    def _verdict(self, spec: StackSpec, group: NodeGroup, place: Place, decision: Decision,
                 known: bool) -> Verdict | None:
        """The place's stock verdict when it may be moved to; None (and the place in
        decision.skipped, with why and the calls made) when not. `known`: only a stock the cloud
        vouches for (a move back), not a type merely offered within quota."""
        why = self.capped.get((group.name, place.index))  # the policy pack's cap: never a move it would refuse
        market = place.market
        if not open_now(market, place.cloud, self.now()):  # a reservation not (or no longer) ours now
            why = (f"its {market.type} window {market.start.isoformat() if market.start else '?'} to "
                   f"{market.end.isoformat() if market.end else '?'} (less {notice_s(place.cloud, market.type)} s "
                   "notice) is not open now")
        if why is not None:  # no call made
            decision.skipped.append({"index": place.index, "place": place.label, "why": why, "calls": 0})
            return None
        try:
            verdict = ask_within(lambda: self.api(place.cloud, place.region), self._ask(spec, group, place),
                                 self.ask_budget_s)
        except Exception as exc:  # noqa: BLE001 (one cloud's API error or outage: the next place is asked)
            decision.skipped.append({"index": place.index, "place": place.label, "calls": None,  # unknown
                                     "why": f"its API failed: {type(exc).__name__}: {str(exc)[:200]}"})
            return None
        if verdict.ok and known and not verdict.known:
            verdict = Verdict(False, f"{verdict.why}: stock unknown, not moved back on a guess", verdict.calls)
        if not verdict.ok:
            decision.skipped.append({"index": place.index, "place": place.label, "why": verdict.why,
                                     "calls": verdict.calls})
            return None
        return verdict

    def _move(self, spec: StackSpec, index: int, group: str, here: Place, to: Place, decision: Decision,
              step: int | None) -> None:
        """Set activeCandidate and run `up`; on a failed `up`, set it back, record the attempt and
        raise MoveFailed (the stack may be half-changed: the next watch's output check says so)."""
        key = f"{self.project}:nodeGroups[{index}].activeCandidate"
        self.workspace.set_config(key, str(to.index))
        try:
            moved = parse_values(self.workspace.config(), self.project, "the stack's config")
            self.workspace.up(f"capacity broker: {group} to {to.label}", for_stack(self.workspace.name, moved))
        except Exception as exc:  # noqa: BLE001 (the Automation API's CommandError and its kin)
            self.workspace.set_config(key, str(here.index))
            lines = str(exc).strip().splitlines()
            failed = lines[-1][:300] if lines else type(exc).__name__
            self._record(spec, group, here, to, decision, step, failed=failed)
            raise MoveFailed(f"{group}: `up` to {to.label} failed ({failed}); activeCandidate set back to "
                             f"{here.index}; the stack may be half-changed: check it with `pulumi preview` and run "
                             "`pulumi up`") from None
        self._record(spec, group, here, to, decision, step)

    def _mismatch(self, group: str, here: Place, outputs: Mapping[str, object]) -> str:
        """The clouds whose outputs hold the group's fleet when the active place's cloud does not."""
        def ids(cloud: str) -> list[object]:
            found = outputs.get(cloud, {})
            fleets = found.get("fleets", {}) if isinstance(found, dict) else {}
            return list(fleets.get(group, []) or []) if isinstance(fleets, dict) else []
        if ids(here.cloud):
            return ""
        return ", ".join(c for c in sorted(outputs) if c != here.cloud and ids(c))

    def _failures(self, here: Place, group: str, outputs: Mapping[str, object],
                  arrived: datetime | None) -> tuple[list[Failure], int | None]:
        """The group's capacity failures here that still stand — newer than its arrival and than its
        last successful launch (the cloud module's filter), and only while the group is short of
        nodes now — and its nodes in service (None when not asked)."""
        fleets = outputs.get(here.cloud, {})
        ids = fleets.get("fleets", {}).get(group, []) if isinstance(fleets, dict) else []
        if not ids:
            return [], None
        api = self.api(here.cloud, here.region)
        since = arrived.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if arrived else None
        found = api.failures(str(ids[0]), since=since)
        if not found:
            return [], None
        running, wanted = api.nodes(str(ids[0]))
        return (found if running < wanted else []), running

    def _ask(self, spec: StackSpec, group: NodeGroup, place: Place) -> Ask:
        types = types_at(spec, group, place)
        items = [spec.catalog().get(place.cloud, t) for t in types]
        vcpus = tuple(item.vcpu if item else 0 for item in items)
        return Ask(place.region, place.zone, types, place.market, max(group.scaling.baseline, 1),
                   vcpus[0] if vcpus else 0, vcpus)

    def _copy(self, spec: StackSpec, group: str, here: Place, to: Place, step: int | None) -> Copied | None:
        if to.cloud == here.cloud:
            return None  # one bucket per cloud: the nodes there read the same checkpoints
        src_bucket, dst_bucket = bucket(spec, here.cloud), bucket(spec, to.cloud)
        src = self.storage(src_bucket, src_bucket.checkpoint_url(group))
        dst = self.storage(dst_bucket, dst_bucket.checkpoint_url(group))
        files, size = copy_step(src, dst, step) if step is not None else (0, 0)
        dfiles, dsize = 0, 0
        if spec.training.dataset:
            rel = f"datasets/{spec.training.dataset}/"
            dfiles, dsize = copy_dataset(self.storage(src_bucket, src_bucket.url + rel),
                                         self.storage(dst_bucket, dst_bucket.url + rel))
        return Copied(step, files, size, dfiles, dsize)

    def _records(self, spec: StackSpec, group: str, place: Place) -> Location:
        where = bucket(spec, place.cloud)
        return self.storage(where, f"{where.url}{RECORDS}/{group}")

    def _arrived(self, spec: StackSpec, group: str, here: Place) -> tuple[datetime | None, int | None]:
        """When the group last moved here (the newest record in this place's bucket), if ever, and
        the committed step it moved with."""
        loc = self._records(spec, group, here)
        try:
            names = sorted(loc.fs.ls(loc.root, detail=False))
        except FileNotFoundError:
            return None, None
        for name in reversed(names):
            record = json.loads(loc.fs.cat(name))
            if record.get("to") == here.index and not record.get("failed"):
                step = record.get("step", (record.get("copied") or {}).get("step"))
                return _when(str(record["at"])), (int(step) if step is not None else None)
        return None, None

    def _record(self, spec: StackSpec, group: str, here: Place, to: Place, decision: Decision, step: int | None,
                failed: str = "") -> None:
        stamp = self.now()
        record = {"at": stamp.isoformat(), "group": group, "from": here.index, "to": to.index, "failed": failed,
                  "step": step,
                  "fromPlace": here.label,
                  "toPlace": to.label, "reason": decision.reason, "skipped": decision.skipped,
                  "copied": asdict(decision.copied) if decision.copied else None}
        loc = self._records(spec, group, to)
        loc.fs.pipe(f"{loc.root}/{stamp.strftime('%Y%m%dT%H%M%S%fZ')}.json",
                    json.dumps(record, indent=1).encode())
