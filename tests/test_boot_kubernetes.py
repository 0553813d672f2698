"""Managed-Kubernetes GPU pool nodes (EKS, ACK, TKE), booted for real (`make boot-test`; in `make test`
too): the plan's exact user data through real cloud-init under real systemd in `systemd-nspawn -b`,
the bundle fetched over TLS from a local object store with the role credentials of a local metadata
service, in a network namespace with no route out (tests/boot/node.py). Skips loudly where the host
cannot boot a container; fails in CI.

Here: each pool's node fetches its bundle, mounts scratch and passes a reclaim notice to the Job's
container through crictl, never installing or training itself; and the ACK pool's node on a NAS
network hands the shared root to the trainer's uid."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.boot.node import Node
from tests.boot.scenario import _bundle_fetched_signed, _no_failed_units, _started, _unit_is, booted_nodes
from tests.harness import run_stack

pytestmark = pytest.mark.boot


@pytest.fixture()
def booted(tmp_path: Path) -> Iterator[Any]:
    """Nodes of the plan, booted for real (tests/boot/scenario.py booted_nodes); closed after the test."""
    yield from booted_nodes(tmp_path)


# The managed-Kubernetes GPU pools' user data, each as its resource carries it: EKS's launch
# template (MIME multipart, its cloud-config part), ACK's node pool (a bash script), TKE's node
# pool (nodeConfig.userData, a bash script).
NODE_POOLS = {
    "eks": ("aws:ec2/launchTemplate:LaunchTemplate", "aws-eks-train-lt", ("userData",)),
    "ack": ("alicloud:cs/nodePool:NodePool", "ali-ack-train-pool", ("userData",)),
    "tke": ("tencentcloud:Kubernetes/nodePool:NodePool", "tc-tke-train-spot", ("nodeConfig", "userData")),
}
# Each cloud's reclaim notice as its metadata service words it (infra/clouds/<cloud>/node.py spot_deadline).
# (the notice, when the node goes in unix time: Tencent's is Beijing time)
SPOT_NOTICES = {"aws": ('{"action": "terminate", "time": "2030-01-01T00:00:00Z"}', 1893456000),
                "alicloud": ("2030-01-01T00:00:00Z", 1893456000),
                "tencentcloud": ("2030-01-01 00:00:00", 1893456000 - 8 * 3600)}


@pytest.mark.parametrize("pool", sorted(NODE_POOLS))
def test_prod_kubernetes_pool_node_fetches_and_watches_but_never_installs_or_trains(booted: Any, pool: str) -> None:
    """A node of the prod EKS / ACK / TKE GPU pool as far as it runs on a plain host: the image
    brings the driver and containerd, the cluster runs the trainer (a Job) and the exporters
    (DaemonSets). The node fetches its bundle with the role's key, mounts scratch and watches for a
    reclaim notice, which reaches the Job's container through crictl and the node exporter's
    textfile directory; no driver, Docker, gate or trainer. None of these groups has a shared file
    system to prepare (EFS needs none: its access point owns the root; the ACK and TKE networks have none)."""
    type_token, name, path = NODE_POOLS[pool]
    node, env = booted("prod", type_token, name, path, image="kubernetes")
    _kubernetes_node(node, env)
    assert "gts-shared: no shared file system for this group" in node.journal_text() and not env["GTS_SHARED_FS"]
    assert not node.archive_served and not [s for s in node.store.served if "/pool/" in s], node.archive_served


def test_ack_pool_node_on_a_nas_network_hands_the_shared_root_to_the_trainer_uid(booted: Any, tmp_path: Path) -> None:
    """prod with NAS on the ACK pool's network: the pool's user data carries the mount target's
    address once it is known (for_cluster_group); the node installs the NFS client, mounts the
    export, hands its root to the trainer's uid (pods cannot chown it) and unmounts it again."""
    def nas(values: dict[str, Any]) -> None:
        for net in values["gpu-training-stack:networks"]:
            if net["name"] == "ali-train":
                net["sharedFs"] = {"type": "nas", "sizeGb": 500}
        for group in values["gpu-training-stack:nodeGroups"]:
            if group["name"] == "ali-ack-train":
                group["sharedFs"] = True

    plan = tuple(run_stack("prod", nas, tmp_path))
    type_token, name, path = NODE_POOLS["ack"]
    node, env = booted("prod", type_token, name, path, image="kubernetes", plan=plan)
    assert env["GTS_SHARED_FS"] == "nfs" and env["GTS_SHARED_SOURCE"].endswith(":/"), env
    export = node.nfs_export / "data"
    assert export.stat().st_uid == 0
    _kubernetes_node(node, env)
    journal = node.journal_text()
    assert "shared: done" in journal and "now belongs to uid 1000 (the trainer)" in journal, journal[-3000:]
    assert export.stat().st_uid == 1000 and oct(export.stat().st_mode & 0o777) == "0o775"
    calls = node.file("/var/log/gts-mount-nfs.calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith(f"mount.nfs {env['GTS_SHARED_SOURCE']} /tmp/"), calls
    assert node.sh("findmnt -n -t nfs,nfs4; findmnt -n -S /srv/gts-nfs/data").stdout.strip() == ""  # unmounted
    assert any(s.startswith("GET /debian/pool/nfs-common.deb") for s in node.archive_served), node.archive_served
    assert not [s for s in node.archive_served if "nvidia" in s or "docker" in s], node.archive_served


def _kubernetes_node(node: Node, env: dict[str, str]) -> None:
    assert env["GTS_MODE"] == "kubernetes" and env["GTS_SPOT_ACTION"] == "crictl:trainer", env
    node.boot()
    node.wait_for(lambda: "node ready (kubernetes)" in node.journal_text(), "the kubernetes bootstrap's end")
    node.wait_for(lambda: _unit_is(node, "gts-spot-watch.service", "active")
                  and _unit_is(node, "gts-scratch.service", "active"), "scratch and the spot watcher")
    order = _started(node)
    # What the units order: the bundle first (it carries the others). Scratch is also wanted by
    # multi-user.target, so it may start before or after the bootstrap's own `start` of it.
    assert order.index("gts-fetch.service") < order.index("gts-bootstrap.service"), order
    assert order.index("gts-fetch.service") < order.index("gts-scratch.service"), order
    for unit in ("gts-trainer.service", "gts-gpu-gate.service", "gts-dataset.service", "gts-exporters.service",
                 "gts-shared.service", "gts-rdzv.service"):
        assert unit not in order, order
    _no_failed_units(node)
    _bundle_fetched_signed(node, env)
    journal = node.journal_text()
    # No driver, runtime or toolkit step: the pool's image has them (EKS: the AL2023 NVIDIA AMI).
    for step in ("driver: starting", "runtime: starting", "fabric: starting"):
        assert step not in journal, step
    assert not node.docker_calls() and not node.file("/var/log/gts-nvidia-ctk.calls").exists()
    assert node.sh("test -d /scratch/checkpoints && test -d /scratch/datasets").returncode == 0
    # A reclaim notice: the node is marked, the notice metric lands in the node exporter's textfile
    # directory (the DaemonSet's hostPath), and the Job's container gets SIGTERM through crictl.
    notice, goes_at = SPOT_NOTICES[env["GTS_CLOUD"]]
    node.meta.spot_notice = notice
    node.wait_for(lambda: node.sh("test -e /run/gpu-training/spot-notice").returncode == 0, "the spot notice mark")
    node.wait_for(lambda: "the trainer exited" in node.journal_text(), "the Job's container checkpointed and exited")
    calls = node.file("/var/log/gts-crictl.calls").read_text().splitlines()
    assert "crictl exec 0123456789ab sh -c kill -TERM 1" in calls, calls
    metric = node.file("/var/lib/node_exporter/textfile/gts_spot.prom").read_text()
    assert f'gts_spot_interruption_notice{{cloud="{env["GTS_CLOUD"]}"}} 1' in metric, metric
    assert re.search(rf"^gts_spot_interruption_time_seconds\{{[^}}]*\}} {goes_at}$", metric, re.M), metric
    assert not node.docker_calls()
