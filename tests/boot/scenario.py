"""What the boot tests share (tests/test_boot_*.py): a node of the plan booted from a resource's
exact user data with its bundle, packages and GPUs in place (booted_nodes, each test file's
`booted` fixture), and the checks every scenario reads from the node — units started and in what
order, the trainer's docker run, the GPU gate, failed units, the signed bundle fetch, the moto Auto
Scaling group whose instance the node becomes."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any, Iterator

from tests.boot import repo
from tests.boot.image import EFA_SYSFS, cache_dir, efa_devices
from tests.boot.node import STORE_ADDRESS, Node, bucket_host, gpu_health
from infra.buckets import image_key
from infra.plan.engine import Registered, unwrap_secrets
from tests.harness import shipped
from tests.nodes import lay_down, node_env

BUNDLE_TYPES = {"aws": "aws:s3/bucketObject:BucketObject", "alicloud": "alicloud:oss/bucketObject:BucketObject",
                "tencentcloud": "tencentcloud:Cos/bucketObject:BucketObject"}
TRAINER_FLAGS = ("--gpus all", "--ipc=host", "--network host", "--ulimit memlock=-1", "--ulimit stack=67108864",
                 "--stop-timeout 110", "--env-file /etc/gpu-training/node.env", "--security-opt no-new-privileges",
                 "--cap-drop NET_RAW")
# Where each cloud's node reads its group's rendezvous key (infra/clouds/<cloud>/node.py rendezvous_key),
# and the plan's resource holding it (name field, value field).
SECRET_HOSTS = {"aws": "ssm.{region}.amazonaws.com", "alicloud": "oos.{region}.aliyuncs.com",
                "tencentcloud": "ssm.tencentcloudapi.com"}
SECRET_VALUES = {"aws:ssm/parameter:Parameter": ("name", "value"),
                 "alicloud:oos/secretParameter:SecretParameter": ("secretParameterName", "value"),
                 "tencentcloud:Ssm/secretVersion:SecretVersion": ("secretName", "secretString")}


def api_url(cloud: str, region: str, override: str) -> str:
    health = gpu_health()
    return health.node_replace.api_url(health.cloudmeta.cloud_node(cloud), region, override)  # type: ignore[no-any-return]


def region_path(cloud: str) -> str:
    """The metadata path of the node's region, as the gate reads it (the cloud's node module)."""
    return gpu_health().cloudmeta.cloud_node(cloud).REGION_PATH  # type: ignore[no-any-return]


def _env_of(raw: bytes, tmp: Path) -> dict[str, str]:
    lay_down(raw, tmp)
    return node_env(tmp)


def _bare_packages(node: Node, env: dict[str, str]) -> None:
    """A bare image's driver path: its packages in the mirrors the plan names (else Ubuntu's archive)."""
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


def _store_object(node: Node, plan: tuple[Registered, ...], cloud: str, bucket: str, key: str, region: str) -> None:
    """The plan's object at `key` (the group's current image), put in the node's store, if the plan has one."""
    if any(r.type == BUNDLE_TYPES[cloud] and r.cloud == cloud and r.inputs["key"] == key for r in plan):
        _store_bundle(node, plan, cloud, bucket, key, region)


def _store_bundle(node: Node, plan: tuple[Registered, ...], cloud: str, bucket: str, key: str, region: str) -> None:
    """The plan's node bundle object, put in the node's store (moto) where its user data fetches it."""
    (obj,) = [r for r in plan if r.type == BUNDLE_TYPES[cloud] and r.cloud == cloud and r.inputs["key"] == key]
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


def _store_key(node: Node, plan: tuple[Registered, ...], cloud: str, ref: str, region: str) -> None:
    """The group's rendezvous key where the plan keeps it: moto's SSM (AWS), else the store's
    OOS / SSM stand-in; node.rdzv_key is what the node must hand its trainer."""
    values = [unwrap_secrets(r.inputs) for r in plan if r.type in SECRET_VALUES]
    (key,) = [str(v[SECRET_VALUES[t][1]]) for t, v in zip([r.type for r in plan if r.type in SECRET_VALUES], values)
              if v[SECRET_VALUES[t][0]] == ref]
    node.rdzv_key = key
    if cloud == "aws":
        node.store.setup(lambda: node.store.client("ssm", region).put_parameter(Name=ref, Value=key, Type="SecureString",
                                                                                Overwrite=True))
    else:
        node.store.secrets[ref] = key


def _rdzv_key_delivered(node: Node, env: dict[str, str], run: str) -> None:
    """A multi-node group's key: fetched at boot with the node's role into a 0600 file, handed to the container."""
    if not env.get("GTS_RDZV_KEY_REF"):
        assert "/run/gpu-training/rdzv.env" not in run, run
        return
    assert "--env-file /run/gpu-training/rdzv.env" in run, run
    got = node.sh("stat -c %a /run/gpu-training/rdzv.env && cat /run/gpu-training/rdzv.env").stdout.split()
    assert got == ["600", f"RDZV_KEY={node.rdzv_key}"], got
    assert "RDZV_KEY=" not in node.file("/etc/gpu-training/node.env").read_text()


def booted_nodes(tmp_path: Path) -> Iterator[Any]:
    """The boot tests' `booted` fixture: make(stack, type_token, name, …) boots that resource's node
    of the plan with its bundle in the store; every node made is closed when the test ends."""
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
                     urlhost(api_url(cloud, region, "")), SECRET_HOSTS[cloud].format(region=region),
                     *([shared_host] if shared_host else [])),
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
        node.meta.extra[region_path(cloud)] = region
        node.packages(repo.NFS_COMMON, repo.AMAZON_EFS_UTILS)  # the archive has the NFS / EFS clients (not the image)
        if image == "bare":  # the driver path's packages, from the mirrors the plan names
            _bare_packages(node, env)
        (node.nfs_export / "exported").touch()  # the shared file system is there (a scenario may take it away)
        # Healthy GPUs by default: as many as the type has (one worker per GPU), NVLinks all up.
        node.gpus(int(env.get("NPROC_PER_NODE", "0")), nvlinks=int(env.get("GTS_NVLINKS") or 0))
        _store_bundle(node, plan, cloud, bucket, key, region)
        _store_object(node, plan, cloud, bucket, image_key(env["GTS_NODE_GROUP"]), region)  # gts-image.py reads it
        if env.get("GTS_RDZV_KEY_REF"):
            _store_key(node, plan, cloud, env["GTS_RDZV_KEY_REF"], region)
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


def _check_trainer_run(run: str, env: dict[str, str], node: Node | None = None) -> None:
    assert re.search(r" \S+@sha256:[0-9a-f]{64}$", run), run  # the image by digest, no arguments
    for flag in TRAINER_FLAGS:
        assert flag in run, (flag, run)
    scratch = env["GTS_SCRATCH_DIR"]
    assert f"-v {scratch}:{scratch}" in run, run
    assert re.search(r"-v \S+:\S+:ro", run), run  # the dataset directory, read-only
    if node is not None:
        _rdzv_key_delivered(node, env, run)


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


def _bundle_fetched_signed(node: Node, env: dict[str, str]) -> None:
    """The bundle came from the cloud's object store host, signed with the role's key."""
    host = bucket_host(env)[2]
    assert any(s.startswith(f"GET {host}/nodes/bundle-") for s in node.store.served), node.store.served
    assert not [r for r in node.store.refused if "/nodes/bundle-" in r], node.store.refused
    assert node.meta.credential_requests > 0
