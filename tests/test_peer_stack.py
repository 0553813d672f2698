"""The peer tier from the stack (training.peerEvery, peerHolders, peerStoreGib; docs/recovery.md):
the settings reach every VM node's env file (as cloud-init writes it) and every Job's trainer, and
pass the container's first check there; unset, no node or Job gets them (the image's defaults
hold, and the plans are as before); a bad value is refused by key before anything is planned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.core.errors import SpecError
from tests.contract_helpers import VM_NODES, container_env, job_containers, node_env_of
from tests.harness import by_type, key, parse_spec, run_stack, shipped, spec_raw, stack_values
from training import contract as c

PEER = (c.PEER_EVERY.name, c.PEER_HOLDERS.name, c.PEER_STORE_GIB.name)


def _trainers(resources: list[Any], tmp: Path) -> list[dict[str, str]]:
    """Every trainer's environment in a plan: each VM node's env file, each Job's trainer container."""
    names = {r.name for r in resources}
    envs = [node_env_of(resources, cloud, tmp / cloud) for cloud, (_, name) in VM_NODES.items() if name in names]
    envs += [container_env(job_containers(job)["trainer"]) for job in by_type(resources, "kubernetes:batch/v1:Job")]
    assert len(envs) >= 4, len(envs)
    return envs


def test_the_stacks_peer_settings_reach_every_node_and_job_and_pass_the_nodes_check(tmp_path: Path) -> None:
    def edit(config: dict[str, Any]) -> None:
        config[key("training")].update({"peerEvery": 20, "peerHolders": 2})

    for env in _trainers(run_stack("prod", edit, tmp_path), tmp_path):
        assert tuple(env.get(name) for name in PEER) == ("20", "2", None)  # the store's budget: the default
        assert c.problems(env) == [], c.problems(env)


def test_without_them_no_trainer_gets_them(tmp_path: Path) -> None:
    for env in _trainers(list(shipped("prod")), tmp_path):
        assert not set(PEER) & set(env)


def _refused(training: dict[str, Any], groups: Any = None) -> list[str]:
    config = stack_values("prod")
    config[key("training")].update(training)
    if groups is not None:
        groups(config[key("nodeGroups")])
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_raw(config))
    return [str(p) for p in caught.value.problems]


@pytest.mark.parametrize("name,value,why", [
    ("peerEvery", -1, "greater than or equal to 0"),
    ("peerEvery", 86401, "less than or equal to 86400"),  # the node's own check's bound
    ("peerEvery", "20; rm -rf /", "is text, not a number; write a number, unquoted"),
    ("peerEvery", True, "true is a YAML boolean, not a number; write a whole number"),
    ("peerHolders", 0, "greater than or equal to 1"),
    ("peerStoreGib", 1.5, "valid integer"),
])
def test_a_bad_peer_setting_is_refused_by_its_key(name: str, value: Any, why: str) -> None:
    problems = _refused({name: value})
    assert any(p.startswith(f"training.{name}") and why in p for p in problems), problems


def test_peer_copies_with_no_multi_node_group_are_refused_by_key() -> None:
    def single(groups: list[dict[str, Any]]) -> None:
        for group in groups:
            group["scaling"] = {"min": 0, "max": 1}
            group.pop("schedule", None)

    problems = _refused({"peerEvery": 20}, single)
    assert any(p.startswith("training.peerEvery: the peer tier copies each node's state to another node of the run")
               for p in problems), problems


def test_peer_copies_with_kubernetes_jobs_of_one_pod_only_are_refused_by_key() -> None:
    """A Job's run is its pods (scaling.desired, else min), not scaling.max: prod's Jobs run one pod
    each, so with its VM groups at one node the tier has no other node to copy to."""
    def single_vms(groups: list[dict[str, Any]]) -> None:
        for group in groups:
            if group.get("kind", "vm") == "vm":
                group["scaling"] = {"min": 0, "max": 1}
                group.pop("schedule", None)

    problems = _refused({"peerEvery": 20}, single_vms)
    assert any(p.startswith("training.peerEvery: the peer tier copies") for p in problems), problems


@pytest.mark.parametrize("name,value", [("peerHolders", 2), ("peerStoreGib", 64)])
def test_a_peer_setting_without_peer_every_is_refused_by_key(name: str, value: int) -> None:
    problems = _refused({name: value})
    assert f"training.{name}: {value} is set while training.peerEvery is 0 (the peer tier is off), so it does " \
           "nothing: set peerEvery too (e.g. 20), or remove it" in problems, problems
