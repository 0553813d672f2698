"""Read once, pass down: the stack file, the team registry and the resolved groups are read and
built at the edge (the program's entry, the plan's, the commands') and handed down; validation
reads no file (the data files under infra/data come through their cached loaders in
infra/core/catalog.py and infra/fabric.py, read at most once per process)."""

from __future__ import annotations

import builtins
import ipaddress
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from infra import rendezvous
from infra.checks import validation
from infra.core.errors import SpecError
from infra.teams import registry
from tests.harness import ROOT, spec_raw, stack_values


@pytest.mark.parametrize("stack", ["dev", "prod", "team-vision"])
def test_validation_reads_no_file_once_the_edge_has_read_them(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = spec_raw(stack_values(stack))
    teams = registry.load(ROOT)  # the edge's read
    validation.parse_stack(raw, "stack", lambda name: teams)  # the data loaders fill their caches

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"validation read a file: {args[:1]}")

    monkeypatch.setattr(builtins, "open", refused)
    for name in ("read_text", "read_bytes", "open", "glob", "exists"):
        monkeypatch.setattr(Path, name, refused)
    stack_ = validation.parse_stack(raw, "stack", lambda name: teams)
    assert stack_.groups and stack_.spec.env == raw["env"]


def test_a_queued_stack_without_a_registry_handed_in_is_refused_not_read() -> None:
    raw = spec_raw(stack_values("prod"))
    assert raw["kubernetes"]["queues"] == "teams.yaml"
    with pytest.raises(SpecError, match="kubernetes.queues: teams.yaml: the team registry was not read"):
        validation.parse(raw, "Pulumi.prod.yaml")


@pytest.fixture
def registry_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names infra.teams.registry.load is asked for, in order, while the test runs."""
    reads: list[str] = []
    real = registry.load

    def counted(root: Path, name: str = registry.REGISTRY) -> registry.Registry:
        reads.append(name)
        return real(root, name)

    monkeypatch.setattr(registry, "load", counted)
    return reads


def test_the_registry_a_stack_names_is_read_once_per_reader(registry_reads: list[str]) -> None:
    from infra.stack.stackfile import teams_reader

    teams = teams_reader(ROOT)
    assert teams("teams.yaml") is teams("teams.yaml") and registry_reads == ["teams.yaml"]


def _block_by_block(taken: list[ipaddress.IPv4Network], cidr: ipaddress.IPv4Network) -> str | None:
    """own_subnet as it was: every /28 of the VPC in order, the first clear of everything taken."""
    for block in cidr.subnets(new_prefix=max(rendezvous.OWN_SUBNET_PREFIX, cidr.prefixlen)):
        if not any(block.overlaps(t) for t in taken):
            return str(block)
    return None


def test_own_subnet_skipping_past_taken_ranges_picks_what_the_block_by_block_scan_picked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(34)
    for _ in range(2000):
        prefix = rng.choice([16, 20, 24, 26, 28, 29])
        cidr = ipaddress.IPv4Network((rng.randrange(2 ** 32) >> (32 - prefix) << (32 - prefix), prefix))
        taken = []
        for _ in range(rng.randrange(6)):
            p = rng.randrange(prefix, 31)
            base = int(cidr.network_address) + rng.randrange(cidr.num_addresses)
            taken.append(ipaddress.IPv4Network((base >> (32 - p) << (32 - p), p)))
        if rng.random() < 0.1:
            taken.append(cidr)  # nothing left
        monkeypatch.setattr(rendezvous, "taken_ranges", lambda spec, net, t=taken: t)
        got = rendezvous.own_subnet(None, SimpleNamespace(cidr=cidr))  # type: ignore[arg-type]
        assert got == _block_by_block(taken, cidr), (cidr, taken)


def test_a_shared_stack_program_reads_its_team_registry_once_for_all_its_clusters(
        registry_reads: list[str]) -> None:
    """prod shares three clusters (EKS, ACK, TKE) through teams.yaml: the program reads it at its
    edge and every cluster's queues are built from that one read (the Stack's teams)."""
    from tests.harness import run_stack

    registered = run_stack("prod")
    shared = [r for r in registered if r.type == "gpu-training-stack:k8s:SharedQueues"]
    assert len(shared) == 3  # one per cluster: EKS, ACK, TKE
    assert registry_reads == ["teams.yaml"]
