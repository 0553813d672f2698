"""The capacity broker: for each node group with candidates, read its launch failures (the
scaling service's activities, infra/clouds/<cloud>/stock.py) and the run's progress (its newest
committed checkpoint in the bucket); when the group cannot get capacity where it is, ask each
other place in order for stock (a few calls each, never a launch), and move the group to the
first that has it: copy the newest committed checkpoint (and the dataset, if absent) to that
cloud's bucket, verified; set nodeGroups[i].activeCandidate in the stack's config and run `up`
(infra/capacity/workspace.py); record the move in the destination bucket
(records/capacity/<group>/). It never moves while a checkpoint is being written, and moves back
to the declared place only when asked to (--move-back) and the declared place has stock again.
docs/capacity.md says how to run it (CI schedule, cron, CronJob)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from infra.buckets import Bucket, bucket
from infra.capacity.places import Place, places
from infra.capacity.pricing import pack_config, types_at
from infra.capacity.stock import Ask, Failure, StockApi, stock_api
from infra.capacity.transfer import Copied, copy_dataset, copy_step, progress
from infra.capacity.workspace import Workspace
from infra.groups import Stack
from infra.policy_config import base_config
from infra.spec import NodeGroup, StackSpec
from infra.stacktext import project_name
from infra.validation import parse_values
from policies.gts_policy.rules_capacity import candidates_capped
from training.storage import Location, location

RECORDS = "records/capacity"


@dataclass
class Decision:
    """What the broker did for one group in one watch."""

    group: str
    action: str  # stay | wait | move
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
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        """`stock(cloud, region)`: the cloud's stock API; `storage(bucket, url)`: a URL in one of the
        stack's buckets, opened with the operator's access to it (infra/capacity/__main__.py builds both)."""
        self.workspace, self.stock, self.storage, self.move_back, self.now = workspace, stock, storage, move_back, now
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
        return [self._group(spec, i, g, outputs) for i, g in enumerate(spec.node_groups) if g.capacity]

    def _group(self, spec: StackSpec, index: int, group: NodeGroup, outputs: Mapping[str, object]) -> Decision:
        every = places(spec, group)
        here = every[group.active_candidate]
        arrived = self._arrived(spec, group.name, here)
        failures = self._failures(here, group.name, outputs, arrived)
        if failures:
            order = every[here.index + 1:] + [p for p in every[:here.index]]
            reason = f"{len(failures)} launch failure(s) at {here.label}: {failures[0].message[:160]}"
        elif self.move_back and here.index != 0:
            order, reason = [every[0]], "the declared place may have capacity again (--move-back)"
        else:
            return Decision(group.name, "stay", f"no launch failure at {here.label}", here.index)
        source = self.storage(bucket(spec, here.cloud), bucket(spec, here.cloud).checkpoint_url(group.name))
        now = progress(source)
        if now.writing is not None:
            return Decision(group.name, "wait", f"{reason}; step {now.writing} is being written: moving after it "
                                                "is committed", here.index)
        decision = Decision(group.name, "stay", f"{reason}; no other place has stock", here.index)
        for place in order:
            why = self.capped.get((group.name, place.index))
            if why is not None:  # the policy pack's cap: never a move it would refuse (no call made)
                decision.skipped.append({"index": place.index, "place": place.label, "why": why, "calls": 0})
                continue
            verdict = self.api(place.cloud, place.region).ask(self._ask(spec, group, place))
            if not verdict.ok:
                decision.skipped.append({"index": place.index, "place": place.label, "why": verdict.why,
                                         "calls": verdict.calls})
                continue
            decision.copied = self._copy(spec, group.name, here, place, now.committed)
            decision.action, decision.at = "move", place.index
            decision.reason = f"{reason}; {place.label}: {verdict.why}"
            self.workspace.set_config(f"{self.project}:nodeGroups[{index}].activeCandidate", str(place.index))
            self.workspace.up(f"capacity broker: {group.name} to {place.label}")
            self._record(spec, group.name, here, place, decision)
            break
        return decision

    def _failures(self, here: Place, group: str, outputs: Mapping[str, object],
                  arrived: datetime | None) -> list[Failure]:
        """The group's capacity failures here that still stand: newer than its arrival and than its last
        successful launch (the cloud module's filter), and only while the group is short of nodes now."""
        fleets = outputs.get(here.cloud, {})
        ids = fleets.get("fleets", {}).get(group, []) if isinstance(fleets, dict) else []
        if not ids:
            return []
        api = self.api(here.cloud, here.region)
        since = arrived.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if arrived else None
        found = api.failures(str(ids[0]), since=since)
        return found if found and api.short(str(ids[0])) else []

    def _ask(self, spec: StackSpec, group: NodeGroup, place: Place) -> Ask:
        types = types_at(spec, group, place)
        item = spec.catalog().get(place.cloud, types[0]) if types else None
        return Ask(place.region, place.zone, types, place.market.type, max(group.scaling.baseline, 1),
                   item.vcpu if item else 0)

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

    def _arrived(self, spec: StackSpec, group: str, here: Place) -> datetime | None:
        """When the group last moved here (the newest record in this place's bucket), if ever."""
        loc = self._records(spec, group, here)
        try:
            names = sorted(loc.fs.ls(loc.root, detail=False))
        except FileNotFoundError:
            return None
        for name in reversed(names):
            record = json.loads(loc.fs.cat(name))
            if record.get("to") == here.index:
                return _when(str(record["at"]))
        return None

    def _record(self, spec: StackSpec, group: str, here: Place, to: Place, decision: Decision) -> None:
        stamp = self.now()
        record = {"at": stamp.isoformat(), "group": group, "from": here.index, "to": to.index, "fromPlace": here.label,
                  "toPlace": to.label, "reason": decision.reason, "skipped": decision.skipped,
                  "copied": asdict(decision.copied) if decision.copied else None}
        loc = self._records(spec, group, to)
        loc.fs.pipe(f"{loc.root}/{stamp.strftime('%Y%m%dT%H%M%S%fZ')}.json",
                    json.dumps(record, indent=1).encode())
