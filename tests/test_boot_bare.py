"""Nodes on bare Ubuntu, booted for real (`make boot-test`; in `make test` too): the plan's exact user
data through real cloud-init under real systemd in `systemd-nspawn -b`, the bundle fetched over TLS
from a local object store with the role credentials of a local metadata service, in a network
namespace with no route out (tests/boot/node.py). Skips loudly where the host cannot boot a
container; fails in CI.

Here: the Alibaba ESS and Tencent AS nodes that install the driver from their cloud's mirrors,
reboot and train, and the rendezvous store instances (AWS, Alibaba, Tencent) that run Docker and the
store only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from infra import userdata
from tests.boot.node import Node
from tests.boot.scenario import (
    _bundle_fetched_signed, _check_trainer_run, _gate_passed, _gate_runs, _no_failed_units, _started, _trainer_runs,
    _unit_is, booted_nodes, urlhost)

pytestmark = pytest.mark.boot


@pytest.fixture()
def booted(tmp_path: Path) -> Iterator[Any]:
    """Nodes of the plan, booted for real (tests/boot/scenario.py booted_nodes); closed after the test."""
    yield from booted_nodes(tmp_path)


def test_dev_alicloud_ess_node_on_bare_ubuntu_installs_the_driver_reboots_and_trains(booted: Any) -> None:
    """The ESS group's launch template user data on bare Ubuntu: its metadata at 100.100.100.200
    (hardened-mode token, the RAM role's credential document), the bundle from OSS's S3 endpoint,
    the driver, docker.io and NVIDIA's toolkit from the plan's mirrors over HTTPS (the image's own
    sources name Ubuntu's archive, which the node cannot reach), the reboot, then the trainer."""
    node, env = booted("dev", "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate", "ali-train-lt", image="bare")
    assert env["GTS_METADATA_URL"] == "http://100.100.100.200"
    node.boot()
    node.wait_for(lambda: node.proc is not None and node.proc.poll() is not None, "the driver install's reboot",
                  timeout=600)
    assert node.wait_exit(10) == 133, node.journal_text()[-4000:]  # systemd-nspawn: the container rebooted
    _trains_after_the_driver_reboot(node, env)
    # OSS's S3 endpoint, V2-signed with the RAM role's AccessKeyId from the credential document.
    _bundle_fetched_signed(node, env)


def _trains_after_the_driver_reboot(node: Node, env: dict[str, str]) -> None:
    journal = node.journal_text()
    assert "gts-driver: driver 535 installed; a reboot loads it" in journal
    assert "driver installed; rebooting" in journal
    apt_host = urlhost(env["GTS_APT_MIRROR"])
    assert any(s.startswith(f"GET {apt_host}/ubuntu/pool/nvidia-driver-535-server.deb 200") for s in node.store.served)
    node.boot()
    node.wait_for(lambda: bool(_trainer_runs(node)), "the trainer's docker run after the reboot", timeout=600)
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "active"), "gts-trainer active")
    (run,) = _trainer_runs(node)
    _check_trainer_run(run, env, node)
    order = _started(node)  # this boot's and the first's: the driver step ran once, before the reboot
    _no_failed_units(node)
    _gate_passed(node, order, env)
    journal = node.journal_text()
    assert "driver: already done" in journal  # the step is stamped: not run again after the reboot
    # Docker and the toolkit came from the mirrors: NVIDIA's flat repository, its key by HTTPS.
    nvidia = urlhost(env["GTS_NVIDIA_MIRROR"])
    assert any(s.startswith(f"GET {nvidia}/libnvidia-container/gpgkey 200") for s in node.store.served)
    assert any(s.startswith(f"GET {nvidia}/libnvidia-container/stable/deb/") and "nvidia-container-toolkit.deb 200" in s
               for s in node.store.served), node.store.served
    assert node.file("/var/log/gts-nvidia-ctk.calls").read_text().startswith("nvidia-ctk runtime configure --runtime=docker")
    assert f"{env['GTS_APT_MIRROR']} " in node.file("/etc/apt/sources.list").read_text()


def test_dev_tencent_as_node_on_bare_ubuntu_installs_the_driver_reboots_and_trains(booted: Any) -> None:
    """The AS group's scaling configuration user data: metadata.tencentyun.com (169.254.0.23, the
    CAM role's credential document), the bundle from COS (SigV4, the role's TmpSecretId), the
    driver path through Tencent's mirrors, the reboot, the trainer."""
    node, env = booted("dev", "tencentcloud:As/scalingConfig:ScalingConfig", "tc-train-config", image="bare")
    assert env["GTS_METADATA_URL"] == "http://metadata.tencentyun.com"
    node.boot()
    node.wait_for(lambda: node.proc is not None and node.proc.poll() is not None, "the driver install's reboot",
                  timeout=600)
    assert node.wait_exit(10) == 133, node.journal_text()[-4000:]
    _trains_after_the_driver_reboot(node, env)
    _bundle_fetched_signed(node, env)
    # The Docker Hub mirror the plan names is Docker's registry-mirrors.
    assert env["GTS_DOCKERHUB_MIRROR"] in node.file("/etc/docker/daemon.json").read_text()


def test_prod_aws_rendezvous_store_runs_docker_and_the_store_only(booted: Any) -> None:
    """The prod AWS store instance (t3.medium, bare Ubuntu): docker.io from Ubuntu's archive, the
    store unit; no driver, no toolkit, no gate, no trainer."""
    node, env = booted("prod", "aws:ec2/instance:Instance", "prod-rdzv-aws-train", ("userDataBase64",), image="bare")
    _store_runs_docker_and_the_store_only(node, env)
    assert any(s.startswith("GET /ubuntu/pool/docker.io.deb") for s in node.archive_served), node.archive_served


# The Alibaba and Tencent stores (ECS / CVM instances on bare Ubuntu), as their resources carry them.
STORES = {"alicloud": ("alicloud:ecs/instance:Instance", "prod-rdzv-ali-train"),
          "tencentcloud": ("tencentcloud:Instance/instance:Instance", "prod-rdzv-tc-train")}


@pytest.mark.parametrize("cloud", sorted(STORES))
def test_prod_china_rendezvous_store_runs_docker_from_the_mirror_and_the_store_only(booted: Any, cloud: str) -> None:
    """The prod Alibaba / Tencent store instance: its cloud's metadata service (100.100.100.200 with
    the hardened-mode token / metadata.tencentyun.com) and role document, the bundle from OSS / COS,
    docker.io from the plan's apt mirror (the image's own archive is unreachable), the store unit."""
    type_token, name = STORES[cloud]
    node, env = booted("prod", type_token, name, image="bare")
    assert env["GTS_CLOUD"] == cloud and env["GTS_METADATA_URL"] == userdata.METADATA_URLS[cloud], env
    _store_runs_docker_and_the_store_only(node, env)
    mirror = urlhost(env["GTS_APT_MIRROR"])
    assert any(s.startswith(f"GET {mirror}/ubuntu/pool/docker.io.deb 200") for s in node.store.served), node.store.served
    assert not node.archive_served, node.archive_served  # nothing from Ubuntu's own archive
    assert f"{env['GTS_APT_MIRROR']} " in node.file("/etc/apt/sources.list").read_text()
    daemon = node.file("/etc/docker/daemon.json").read_text()
    assert (env["GTS_DOCKERHUB_MIRROR"] in daemon) if env["GTS_DOCKERHUB_MIRROR"] else "registry-mirrors" not in daemon


def _store_runs_docker_and_the_store_only(node: Node, env: dict[str, str]) -> None:
    assert env["GTS_MODE"] == "rendezvous"
    node.boot()
    node.wait_for(lambda: _unit_is(node, "gts-rdzv.service", "active"), "gts-rdzv active")
    node.wait_for(lambda: any("--name gts-rdzv" in c for c in node.docker_calls()), "the store's docker run")
    (run,) = [c for c in node.docker_calls() if c.startswith("docker run") and "--name gts-rdzv" in c]
    assert re.search(r" --entrypoint python \S+@sha256:[0-9a-f]{64} -m training\.node\.rdzv_store --host "
                     + re.escape(env["GTS_RDZV_HOST"]) + r" --port 29400$", run), run
    _no_failed_units(node)
    order = _started(node)
    assert order.index("gts-bootstrap.service") < order.index("gts-rdzv.service"), order
    for unit in ("gts-trainer.service", "gts-gpu-gate.service", "gts-dataset.service"):
        assert unit not in order, order
    journal = node.journal_text()
    assert "runtime: done" in journal and "driver: starting" not in journal
    assert not node.file("/var/log/gts-nvidia-ctk.calls").exists() and not node.file("/usr/bin/nvidia-smi").exists()
    assert not _trainer_runs(node) and not _gate_runs(node)
    assert node.boots == 1
    _bundle_fetched_signed(node, env)
