"""Node kinds booted for real (`make boot-test`; in `make test` too): the plan's exact user data
through real cloud-init under real systemd in `systemd-nspawn -b`, the bundle fetched over TLS
from a local object store with the role credentials of a local metadata service on
169.254.169.254, in a network namespace with no route out (tests/boot/node.py). Skips loudly
where the host cannot boot a container; fails in CI instead."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.boot import repo
from tests.boot.node import EFA_SYSFS, STORE_ADDRESS, Node, bucket_host, cache_dir, efa_devices, gpu_health
from infra import userdata
from infra.plan.engine import Registered, unwrap_secrets
from tests.harness import run_stack, shipped
from tests.nodes import lay_down, node_env

pytestmark = pytest.mark.boot
HERE = Path(__file__).parent
REGION = gpu_health().node_replace.REGION  # the metadata path of the node's region, as the gate reads it
BUNDLE_TYPES = {"aws": "aws:s3/bucketObject:BucketObject", "alicloud": "alicloud:oss/bucketObject:BucketObject",
                "tencentcloud": "tencentcloud:Cos/bucketObject:BucketObject"}
TRAINER_FLAGS = ("--gpus all", "--ipc=host", "--network host", "--ulimit memlock=-1", "--ulimit stack=67108864",
                 "--stop-timeout 110", "--env-file /etc/gpu-training/node.env")


def api_url(cloud: str, region: str, override: str) -> str:
    return gpu_health().node_replace.api_url(cloud, region, override)  # type: ignore[no-any-return]


def _env_of(raw: bytes, tmp: Path) -> dict[str, str]:
    lay_down(raw, tmp)
    return node_env(tmp)


@pytest.fixture()
def booted(tmp_path: Path) -> Iterator[Any]:
    nodes: list[Node] = []

    def make(stack: str, type_token: str, name: str, path: tuple[str, ...] = ("userData",),
             image: str = "dlami", plan: tuple[Registered, ...] | None = None) -> tuple[Node, dict[str, str]]:
        """`plan`: the registrations of an edited stack (tests.harness.run_stack), else the shipped one's."""
        plan = plan if plan is not None else shipped(stack)
        raw = _user_data(plan, type_token, name, path)
        env = _env_of(raw, tmp_path / "decoded")
        cloud = env["GTS_CLOUD"]
        bucket, key, host = bucket_host(env)
        region = env["STORAGE_REGION"]
        shared_host = env.get("GTS_SHARED_SOURCE", "").split(":")[0]
        # A bare image reaches Ubuntu's archive and NVIDIA's repository only through the plan's mirrors.
        mirrors = tuple(urlhost(env[k]) for k in ("GTS_APT_MIRROR", "GTS_NVIDIA_MIRROR") if image == "bare" and env[k])
        node = Node(tmp_path / "node", cloud, raw,
                    (host, urlhost(env["STORAGE_ENDPOINT_URL"]), f"api.ecr.{region}.amazonaws.com",
                     urlhost(api_url(cloud, region, "")), *([shared_host] if shared_host else [])),
                    # The DLAMI has assembled the instance store at /opt/dlami/nvme (a mount). Elsewhere
                    # scratch is a mount already: the node must never see (and format) the host's disks.
                    nspawn_args=(("--tmpfs=/opt/dlami/nvme",) if image == "dlami" else ("--tmpfs=/scratch",))
                    + (efa_devices(tmp_path / "efa", int(env["GTS_FABRIC_DEVICES"])) if env.get("GTS_FABRIC") == "efa"
                       else ()),
                    image=image,
                    mirrors=tuple(dict.fromkeys(mirrors)))
        nodes.append(node)
        if env.get("GTS_FABRIC") == "efa":  # the fabric check reads the stand-in devices (efa_devices)
            node.drop_in("gts-trainer.service", f"[Service]\nEnvironment=GTS_SYSFS={EFA_SYSFS}\n")
        node.meta.extra[REGION[cloud]] = region
        node.packages(repo.NFS_COMMON, repo.AMAZON_EFS_UTILS)  # the archive has the NFS / EFS clients (not the image)
        if image == "bare":  # the driver path's packages, from the mirrors the plan names
            apt, nvidia = env["GTS_APT_MIRROR"], env["GTS_NVIDIA_MIRROR"]
            bare = (repo.NFS_COMMON, repo.DOCKER_IO, *repo.driver_packages(os.uname().release, env["GTS_DRIVER_BRANCH"]))
            if apt:
                node.packages(*bare, root=node.mirror(urlhost(apt)) / urlpath(apt))
            else:  # Ubuntu's own archive (the image's sources), over plain HTTP as Ubuntu serves it
                node.packages(*bare, root=node.archive_dir / "ubuntu")
                with open(node.upper / "etc/hosts", "a") as hosts:
                    hosts.write(f"{STORE_ADDRESS} archive.ubuntu.com\n")
            if nvidia:
                toolkit = node.mirror(urlhost(nvidia)) / urlpath(nvidia)
                node.packages(repo.NVIDIA_CONTAINER_TOOLKIT, root=toolkit / f"stable/deb/{repo.dpkg_arch()}", flat=True)
                (toolkit / "gpgkey").write_bytes(repo.armored_key(cache_dir()))
        (node.nfs_export / "exported").touch()  # the shared file system is there (a scenario may take it away)
        # Healthy GPUs by default: as many as the type has (one worker per GPU), NVLinks all up.
        node.gpus(int(env.get("NPROC_PER_NODE", "0")), nvlinks=int(env.get("GTS_NVLINKS") or 0))
        (obj,) = [r for r in plan if r.type == BUNDLE_TYPES[cloud] and r.cloud == cloud
                  and r.inputs["key"] == key]
        body = obj.inputs["content"].encode()

        def put() -> None:
            s3 = node.store.client("s3", region)
            try:
                s3.create_bucket(Bucket=bucket) if region == "us-east-1" else s3.create_bucket(
                    Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": region})
            except s3.exceptions.BucketAlreadyOwnedByYou:  # moto's state is the process's: an earlier node's
                pass
            s3.put_object(Bucket=bucket, Key=key, Body=body)

        node.store.setup(put)
        return node, env

    yield make
    for node in nodes:
        node.close()


def _user_data(plan: tuple[Registered, ...], type_token: str, name: str, path: tuple[str, ...]) -> bytes:
    """A resource's user data as the plan registered it (tests/nodes.py user_data, any plan)."""
    value: Any = unwrap_secrets(next(r for r in plan if r.type == type_token and r.name == name).inputs)
    for key in path:
        value = value[key]
    return base64.b64decode(value)


def urlhost(url: str) -> str:
    return re.sub(r"^https?://", "", url).split("/")[0]


def urlpath(url: str) -> str:
    return re.sub(r"^https?://[^/]*/?", "", url)


def _unit_is(node: Node, unit: str, state: str) -> bool:
    return node.sh(f"systemctl is-active {unit}").stdout.strip() == state


def _trainer_runs(node: Node) -> list[str]:
    return [c for c in node.docker_calls() if c.startswith("docker run") and "--name gts-trainer" in c]


def _started(node: Node) -> list[str]:
    """gts-* units in the order systemd finished starting them (from the node's journal)."""
    order = []
    for entry in node.journal():
        unit = entry.get("UNIT", "")
        if entry.get("JOB_TYPE") == "start" and entry.get("JOB_RESULT") == "done" and unit.startswith("gts-"):
            order.append(unit)
    return order


def _check_trainer_run(run: str, env: dict[str, str]) -> None:
    assert re.search(r" \S+@sha256:[0-9a-f]{64}$", run), run  # the image by digest, no arguments
    for flag in TRAINER_FLAGS:
        assert flag in run, (flag, run)
    scratch = env["GTS_SCRATCH_DIR"]
    assert f"-v {scratch}:{scratch}" in run, run
    assert re.search(r"-v \S+:\S+:ro", run), run  # the dataset directory, read-only


def _no_failed_units(node: Node) -> None:
    failed = node.sh("systemctl list-units --failed --plain --no-legend --no-pager").stdout
    # cloud-config.service fails in this Debian minbase root on cloud-init's locale module (not on the
    # user data: write_files runs in cloud-init.service, runcmd in cloud-final.service).
    bad = [line.split()[0] for line in failed.splitlines() if line.strip() and not line.startswith("cloud-config.")]
    why = {unit: node.sh(f"journalctl -b -u {unit} --no-pager | tail -25; "
                         f"grep -B2 -A8 -E 'Traceback|failed' /var/log/cloud-init.log | tail -40").stdout
           for unit in bad}
    assert not bad, why


def _gate_runs(node: Node) -> list[str]:
    return [c for c in node.docker_calls() if c.startswith("docker run") and "dcgmi\\ diag" in c]


def _gate_passed(node: Node, order: list[str], env: dict[str, str]) -> None:
    """The GPU boot gate ran for real before the trainer, and its checks passed: GPU count and
    persistence mode from nvidia-smi, dcgmi diag in the DCGM exporter's image (the host has none)."""
    assert order.index("gts-gpu-gate.service") < order.index("gts-trainer.service"), order
    (diag,) = _gate_runs(node)
    assert f"--entrypoint sh {env['GTS_DCGM_EXPORTER_IMAGE']} -c" in diag, diag
    passed = [line for line in node.journal_text().splitlines() if "GPU gate passed" in line]
    assert len(passed) == 1 and "gpu_count: nvidia-smi sees" in passed[0] and "dcgm_diag: dcgmi diag -r 1: passed" \
        in passed[0], passed
    metrics = node.file("/var/lib/node_exporter/textfile/gts_gpu_gate.prom").read_text()
    assert re.search(r"^gts_gpu_gate_ok\{[^}]*\} 1$", metrics, re.M), metrics


def _moto_group(node: Node, region: str) -> str:
    """A real Auto Scaling group with one instance in moto; the node becomes that instance."""
    def make() -> str:
        client = node.store.client("autoscaling", region)
        client.create_launch_configuration(LaunchConfigurationName="gts-boot-lc", ImageId="ami-12c6146b",
                                           InstanceType="p4d.24xlarge")
        client.create_auto_scaling_group(AutoScalingGroupName="gts-boot-asg", LaunchConfigurationName="gts-boot-lc",
                                         MinSize=1, MaxSize=2, DesiredCapacity=1, AvailabilityZones=[f"{region}a"])
        return str(client.describe_auto_scaling_groups()["AutoScalingGroups"][0]["Instances"][0]["InstanceId"])

    instance = node.store.setup(make)
    node.set_instance(instance)
    return instance


def _health(node: Node, region: str, instance: str) -> str:
    found = node.store.setup(lambda: node.store.client("autoscaling", region).describe_auto_scaling_instances(
        InstanceIds=[instance])["AutoScalingInstances"])
    return str(found[0]["HealthStatus"])


def test_dev_aws_fleet_boots_on_the_dlami_to_a_running_trainer_and_stops_on_a_spot_notice(booted: Any) -> None:
    node, env = booted("dev", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    node.boot()
    node.wait_for(lambda: bool(_trainer_runs(node)), "the trainer's docker run")
    node.wait_for(lambda: _unit_is(node, "gts-trainer.service", "active"), "gts-trainer active")
    (run,) = _trainer_runs(node)
    _check_trainer_run(run, env)
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


def test_a_node_one_gpu_short_fails_its_gate_never_trains_and_its_group_replaces_it(booted: Any) -> None:
    """The prod AWS group (p4d: 8 GPUs, NVSwitch, 12 NVLinks each) on a node that sees 7."""
    node, env = booted("prod", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    region = env["STORAGE_REGION"]
    instance = _moto_group(node, region)
    assert _health(node, region, instance) == "Healthy"
    node.gpus(int(env["NPROC_PER_NODE"]) - 1, nvlinks=int(env["GTS_NVLINKS"]))  # one GPU fell off the bus
    node.boot()
    node.wait_for(lambda: node.sh("systemctl is-failed gts-gpu-gate.service").stdout.strip() == "failed",
                  "the GPU gate failed")
    # The replacement request: SetInstanceHealth signed with the role's key, at moto's Auto Scaling over TLS.
    api = urlhost(api_url("aws", region, ""))
    node.wait_for(lambda: any(s.startswith(f"POST {api}/") for s in node.store.served), "SetInstanceHealth")
    assert _health(node, region, instance) == "Unhealthy"
    assert not [r for r in node.store.refused if api in r], node.store.refused
    journal = node.journal_text()
    failed = [line for line in journal.splitlines() if "GPU gate FAILED" in line]
    assert len(failed) == 1 and "gpu_count: nvidia-smi sees 7 GPUs, the type has 8" in failed[0], failed  # one line
    assert "fabric_manager" not in failed[0] and "dcgm_diag" not in failed[0], failed  # those passed
    assert "asked the aws group to replace instance " + instance in journal
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
    _check_trainer_run(run, env)
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


def _bundle_fetched_signed(node: Node, env: dict[str, str]) -> None:
    """The bundle came from the cloud's object store host, signed with the role's key."""
    host = bucket_host(env)[2]
    assert any(s.startswith(f"GET {host}/nodes/bundle-") for s in node.store.served), node.store.served
    assert not [r for r in node.store.refused if "/nodes/bundle-" in r], node.store.refused
    assert node.meta.credential_requests > 0


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
    _check_trainer_run(run, env)
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


def test_a_one_gpu_node_that_lost_its_gpu_keeps_its_driver_fails_its_gate_and_is_replaced(booted: Any) -> None:
    """The dev AWS group (one GPU) where nvidia-smi finds no device (exit 6): the driver is there,
    so the driver step goes on (no apt), the gate fails on the count and asks for a replacement."""
    node, env = booted("dev", "aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt")
    assert env["NPROC_PER_NODE"] == "1"
    region = env["STORAGE_REGION"]
    instance = _moto_group(node, region)
    node.gpus(0)
    node.boot()
    node.wait_for(lambda: node.sh("systemctl is-failed gts-gpu-gate.service").stdout.strip() == "failed",
                  "the GPU gate failed")
    api = urlhost(api_url("aws", region, ""))
    node.wait_for(lambda: any(s.startswith(f"POST {api}/") for s in node.store.served), "SetInstanceHealth")
    assert _health(node, region, instance) == "Unhealthy"
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
    _check_trainer_run(run, env)
    assert "-v /shared:/shared" in run and node.sh("findmnt -n /shared").returncode == 0, run
    calls = node.file("/var/log/gts-mount-efs.calls").read_text().splitlines()
    assert len(calls) >= 2 and all(c.startswith(f"mount.efs {env['GTS_SHARED_SOURCE']} /shared") for c in calls)
    order = _started(node)
    assert order.index("gts-shared.service") < order.index("gts-trainer.service"), order
    _no_failed_units(node)


# The managed-Kubernetes GPU pools' user data, each as its resource carries it: EKS's launch
# template (MIME multipart, its cloud-config part), ACK's node pool (a bash script), TKE's node
# pool (nodeConfig.userData, a bash script).
NODE_POOLS = {
    "eks": ("aws:ec2/launchTemplate:LaunchTemplate", "aws-eks-train-lt", ("userData",)),
    "ack": ("alicloud:cs/nodePool:NodePool", "ali-ack-train-pool", ("userData",)),
    "tke": ("tencentcloud:Kubernetes/nodePool:NodePool", "tc-tke-train-spot", ("nodeConfig", "userData")),
}
# Each cloud's reclaim notice as its metadata service words it (training/cloudmeta.py).
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
