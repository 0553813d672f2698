"""AWS GPU group nodes on the Deep Learning AMI, booted for real (`make boot-test`; in `make test`
too): the plan's exact user data through real cloud-init under real systemd in `systemd-nspawn -b`,
the bundle fetched over TLS from a local object store with the role credentials of a local metadata
service, in a network namespace with no route out (tests/boot/node.py). Skips loudly where the host
cannot boot a container; fails in CI.

Here: the dev fleet to a running trainer and its spot notice, the GPU gate failing on a missing GPU
(and on a lost one) and the group replacing the node, the dataset cache's retry, a role that appears
late and a shared file system that mounts late."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.boot.node import bucket_host
from tests.boot.scenario import (
    _bundle_fetched_signed, _check_trainer_run, _gate_passed, _gate_runs, _health, _moto_group, _no_failed_units,
    _started, _trainer_runs, _unit_is, api_url, booted_nodes, urlhost)

pytestmark = pytest.mark.boot


@pytest.fixture()
def booted(tmp_path: Path) -> Iterator[Any]:
    """Nodes of the plan, booted for real (tests/boot/scenario.py booted_nodes); closed after the test."""
    yield from booted_nodes(tmp_path)


def test_dev_aws_fleet_boots_on_the_dlami_to_a_running_trainer_and_stops_on_a_spot_notice(booted: Any) -> None:
    node, env = booted("dev", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    node.boot()
    node.wait_for(lambda: bool(_trainer_runs(node)), "the trainer's docker run")
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "active"), "gts-trainer active")
    (run,) = _trainer_runs(node)
    _check_trainer_run(run, env, node)
    order = _started(node)
    assert order.index("gts-fetch.service") < order.index("gts-bootstrap.service") < order.index("gts-trainer.service")
    assert order.index("gts-scratch.service") < order.index("gts-trainer.service")
    _no_failed_units(node)
    _gate_passed(node, order, env)
    # The exporters and the trainer's metrics listen on the node's own address, never on every interface.
    addr = node.sh("/usr/local/sbin/gts-node-addr.sh").stdout.strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", addr) and addr != "0.0.0.0", addr
    node.wait_for(lambda: len([c for c in node.docker_calls() if "--name gts-node-exporter" in c]) == 1, "the exporters")
    (dcgm,) = [c for c in node.docker_calls() if c.startswith("docker run") and "--name gts-dcgm-exporter" in c]
    (nodex,) = [c for c in node.docker_calls() if c.startswith("docker run") and "--name gts-node-exporter" in c]
    assert f"-p {addr}:9400:9400" in dcgm and f"--web.listen-address={addr}:9100" in nodex, (dcgm, nodex)
    assert f"METRICS_ADDR={addr}" in run, run
    # The bundle came signed with the role's key; an unsigned request is refused.
    assert any("/nodes/bundle-" in s for s in node.store.served), node.store.served
    assert not [r for r in node.store.refused if "/nodes/bundle-" in r], node.store.refused
    unsigned = node.sh(f"curl -s -o /dev/null -w '%{{http_code}}' https://{bucket_host(env)[2]}/{bucket_host(env)[1]}")
    assert unsigned.stdout == "403", unsigned
    # A spot notice: the watcher marks the node and signals the trainer container; it is not restarted.
    node.meta.spot_notice = '{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
    node.wait_for(lambda: node.sh("test -e /run/gpu-training/spot-notice").returncode == 0, "the spot notice mark")
    node.wait_for(lambda: any(c.startswith("docker kill --signal TERM gts-trainer") for c in node.docker_calls()),
                  "docker kill --signal TERM gts-trainer")
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "inactive"), "the trainer stopped")
    assert len(_trainer_runs(node)) == 1  # never started again on a reclaimed node


def _gate_failed_and_replaced(node: Any, region: str, instance: str) -> str:
    """The GPU gate failed, and the replacement request (SetInstanceHealth signed with the role's
    key, at moto's Auto Scaling over TLS) marked the instance Unhealthy; the API's host."""
    node.wait_for(lambda: node.sh("systemctl is-failed gts-gpu-gate.service").stdout.strip() == "failed",
                  "the GPU gate failed")
    api = urlhost(api_url("aws", region, ""))
    node.wait_for(lambda: any(s.startswith(f"POST {api}/") for s in node.store.served), "SetInstanceHealth")
    assert _health(node, region, instance) == "Unhealthy"
    return api


def test_a_node_one_gpu_short_fails_its_gate_never_trains_and_its_group_replaces_it(booted: Any) -> None:
    """The prod AWS group (p4d: 8 GPUs, NVSwitch, 12 NVLinks each) on a node that sees 7."""
    node, env = booted("prod", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    region = env["STORAGE_REGION"]
    instance = _moto_group(node, region)
    assert _health(node, region, instance) == "Healthy"
    node.gpus(int(env["NPROC_PER_NODE"]) - 1, nvlinks=int(env["GTS_NVLINKS"]))  # one GPU fell off the bus
    node.boot()
    api = _gate_failed_and_replaced(node, region, instance)
    assert not [r for r in node.store.refused if api in r], node.store.refused
    journal = node.journal_text()
    failed = [line for line in journal.splitlines() if "GPU gate FAILED" in line]
    assert len(failed) == 1 and "gpu_count: nvidia-smi sees 7 GPUs, the type has 8" in failed[0], failed  # one line
    assert "fabric_manager" not in failed[0] and "dcgm_diag" not in failed[0], failed  # those passed
    assert "asked the aws group to replace instance " + instance in journal
    # first a slot of the group's replacement budget, in the run's bucket (training/node/replace_budget.py)
    assert re.search(r"gate:gpu_count: took replacement slot checkpoints/[^ ]+/replacements/\d{10}/slot-0", journal)
    metrics = node.file("/var/lib/node_exporter/textfile/gts_gpu_gate.prom").read_text()
    assert re.search(r'^gts_gpu_gate_ok\{[^}]*\} 0$', metrics, re.M), metrics
    assert re.search(r'^gts_gpu_gate_check_ok\{check="gpu_count",[^}]*\} 0$', metrics, re.M), metrics
    assert re.search(r'^gts_gpu_replace_requested\{[^}]*reason="gate:gpu_count"[^}]*\} 1$', metrics, re.M), metrics
    # The trainer never started, and nothing starts it later (the gate's mark is its condition).
    node.wait_for(lambda: "Dependency failed for gts-trainer.service" in node.journal_text(), "the trainer not started")
    node.wait_for(lambda: _unit_is(node, "gts-dataset.service", "active") and _unit_is(node, "gts-shared.service", "active"),
                  "the trainer's other inputs done (each starts the trainer again)")
    assert node.sh("test -e /run/gpu-training/spot-notice").returncode == 0
    assert not _trainer_runs(node) and _unit_is(node, "gts-trainer.service", "inactive")
    assert len(_gate_runs(node)) == 1  # the gate ran once: every check, the diag too
    assert sum("SetInstanceHealth" in s or s.startswith(f"POST {api}/") for s in node.store.served) == 1


def test_prod_aws_group_caches_its_dataset_then_trains_also_when_the_copy_fails_first(booted: Any) -> None:
    node, env = booted("prod", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    state = node.upper / "var/lib/gts-docker-stub"
    state.mkdir(parents=True)
    (state / "dataset-failures").write_text("1")  # the first copy fails
    node.drop_in("gts-dataset.service", "[Service]\nRestartSec=1\n")  # the retry without its minute's wait
    node.boot()
    node.wait_for(lambda: bool(_trainer_runs(node)), "the trainer's docker run after the dataset's retry")
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "active"), "gts-trainer active")
    copies = [c for c in node.docker_calls() if "training.node.datasync" in c]
    assert len(copies) == 2, copies  # failed once, then succeeded
    for copy in copies:
        assert re.search(r" --entrypoint python \S+@sha256:[0-9a-f]{64} -m training\.node\.datasync ", copy), copy
    assert node.sh("cat /scratch/datasets/current/.gts-copied").stdout.strip() == env["DATASET_URL"]
    calls = node.docker_calls()
    assert calls.index(copies[-1]) < calls.index(_trainer_runs(node)[0])
    (run,) = _trainer_runs(node)
    _check_trainer_run(run, env, node)
    # The RAM copy (GTS_TMPFS_GB) is what the trainer reads, mounted into the container.
    data_dir = node.sh(". /etc/gpu-training/node.env; echo $DATA_DIR").stdout.strip()
    assert f"-v {data_dir}:{data_dir}:ro" in run, (data_dir, run)
    assert "Dependency failed for gts-trainer.service" in node.journal_text()  # the fault did happen
    assert node.sh("systemctl is-failed gts-dataset.service").stdout.strip() == "active"
    # The shared file system came from the archive's NFS client and is mounted for the trainer.
    assert node.sh("findmnt -n /shared").returncode == 0 and "-v /shared:/shared" in run, run
    # The group's EFA fabric: the DLAMI's user space kept, the 4 devices seen, NCCL selects EFA, and
    # the trainer gets the devices (gts-fabric.sh check; the devices are stand-ins, efa_devices).
    assert "gts-fabric: fabric check: efa with 4 devices" in node.journal_text()
    assert "--device=/dev/infiniband" in run and "--cap-add=IPC_LOCK" in run, run
    assert node.file("/var/log/gts-mount-efs.calls").read_text().startswith(f"mount.efs {env['GTS_SHARED_SOURCE']} /shared")

def test_a_one_gpu_node_that_lost_its_gpu_keeps_its_driver_fails_its_gate_and_is_replaced(booted: Any) -> None:
    """The dev AWS group (one GPU) where nvidia-smi finds no device (exit 6): the driver is there,
    so the driver step goes on (no apt), the gate fails on the count and asks for a replacement."""
    node, env = booted("dev", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    assert env["NPROC_PER_NODE"] == "1"
    region = env["STORAGE_REGION"]
    instance = _moto_group(node, region)
    node.gpus(0)
    node.boot()
    _gate_failed_and_replaced(node, region, instance)
    journal = node.journal_text()
    assert "gts-driver: nvidia-smi exits 6 with a driver loaded" in journal, journal[-4000:]
    assert "apt-get" not in journal and not node.archive_served  # no driver install was tried
    failed = [line for line in journal.splitlines() if "GPU gate FAILED" in line]
    assert len(failed) == 1 and "gpu_count" in failed[0], failed
    assert "asked the aws group to replace instance " + instance in journal
    assert not _trainer_runs(node)


def test_a_node_whose_role_appears_late_waits_for_it_then_trains(booted: Any) -> None:
    """The dev AWS node boots before its instance profile's credentials are there (the metadata
    service answers 404 for them): the fetcher keeps asking, and goes on once they appear."""
    node, env = booted("dev", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    node.meta.mode = "404"
    node.boot()
    node.wait_for(lambda: node.meta.credential_requests >= 2, "the fetch asking for the role again")
    assert not _trainer_runs(node) and not [s for s in node.store.served if s.startswith("GET ") and "/nodes/bundle-" in s]
    node.meta.mode = "ok"  # the role is attached
    node.wait_for(lambda: bool(_trainer_runs(node)), "the trainer's docker run once the role is there")
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "active"), "gts-trainer active")
    _check_trainer_run(_trainer_runs(node)[0], env)
    assert len(_trainer_runs(node)) == 1
    assert _unit_is(node, "gts-fetch.service", "active")  # the fetcher's own retry waited: no unit failure
    _no_failed_units(node)
    _bundle_fetched_signed(node, env)


def test_prod_aws_node_whose_shared_file_system_mounts_late_waits_then_trains(booted: Any) -> None:
    """The EFS mount target is not there at boot (mount.efs refused): gts-shared keeps trying, the
    trainer waits; once the export appears the mount succeeds and the trainer starts, once."""
    node, env = booted("prod", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    (node.nfs_export / "exported").unlink()
    node.boot()
    node.wait_for(lambda: "not mountable yet (try 1 of" in node.journal_text(), "the first refused mount")
    assert not _trainer_runs(node)
    (node.nfs_export / "exported").touch()  # the mount target comes up
    node.wait_for(lambda: bool(_trainer_runs(node)), "the trainer's docker run after the late mount")
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "active"), "gts-trainer active")
    (run,) = _trainer_runs(node)
    _check_trainer_run(run, env, node)
    assert "-v /shared:/shared" in run and node.sh("findmnt -n /shared").returncode == 0, run
    calls = node.file("/var/log/gts-mount-efs.calls").read_text().splitlines()
    assert len(calls) >= 2 and all(c.startswith(f"mount.efs {env['GTS_SHARED_SOURCE']} /shared") for c in calls)
    order = _started(node)
    assert order.index("gts-shared.service") < order.index("gts-trainer.service"), order
    _no_failed_units(node)
