"""The seam stack -> training container. What the plan hands a trainer — a VM node's env file
decoded from its real user data, a Kubernetes Job's container env — is fed, as it is, to the
real trainer (training/node/entrypoint.sh, torchrun, gloo on CPU) against an S3 server on 127.0.0.1,
with the credentials each group's nodes really have: the instance role from a local metadata
server in the cloud's format, EKS Pod Identity, ACK RRSA (an STS exchange of the pod's token)
or the TKE node's CAM role. A proxy in front of the bucket notes which access key signed each
request, so the test proves the role's credentials were used, not some default.

Only what a node has and this machine has not is replaced (`node_only`): the bucket's address
and addressing style, scratch paths, GPUs, ports, the metadata and STS addresses; and prod's
ResNet-50 on ImageNet becomes the tiny workload, which a CPU trains in seconds."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from infra.spec import StackSpec
from tests.harness import parse_spec
from infra.plan.engine import Registered
from tests.harness import ROOT, by_type, shipped, spec_raw, stack_values
from tests.metadata_server import POD_IDENTITY_PATH, FakeMetadata
from tests.nodes import lay_down, node_env, registered, user_data
from tests.training_helpers import BIN, FINAL, LAUNCH_TIMEOUT, MotoServer, Proxy, free_port
from training import contract
from training.cloudmeta import MetadataError
from training.trainer import config

VM_NODES = {  # dev's VM groups: (launch resource type, name)
    "aws": ("aws:ec2/launchTemplate:LaunchTemplate", "aws-train-lt"),
    "alicloud": ("alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate", "ali-train-lt"),
    "tencentcloud": ("tencentcloud:As/scalingConfig:ScalingConfig", "tc-train-config"),
}
JOBS = {"aws": "aws-eks-train-job", "alicloud": "ali-ack-train-job", "tencentcloud": "tc-tke-train-job"}
STEPS = 3

STORE_TYPES = {"aws": "aws:ec2/instance:Instance", "alicloud": "alicloud:ecs/instance:Instance",
               "tencentcloud": "tencentcloud:Instance/instance:Instance"}


def _spec(stack: str) -> StackSpec:
    return parse_spec(spec_raw(stack_values(stack)))


def vm_env(stack: str, cloud: str, tmp: Path) -> dict[str, str]:
    """A VM node's /etc/gpu-training/node.env, from its user data as cloud-init writes it: the
    trainer container gets this file with `docker run --env-file` (gts-trainer.service)."""
    return node_env_of(list(shipped(stack)), cloud, tmp)


def node_env_of(resources: list[Registered], cloud: str, tmp: Path) -> dict[str, str]:
    """The same for the registrations of any (edited) stack."""
    type_token, name = VM_NODES[cloud]
    (node,) = [r for r in by_type(resources, type_token) if r.name == name]
    root = tmp / f"node-{cloud}"
    from infra.plan.engine import unwrap_secrets

    lay_down(base64.b64decode(unwrap_secrets(node.inputs["userData"])), root)  # secret: it holds the rendezvous key
    return node_env(root)


def job_containers(job: Registered) -> dict[str, dict[str, Any]]:
    pod = job.inputs["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*(pod.get("initContainers") or []), *pod["containers"]]}


def container_env(container: dict[str, Any], completion_index: int = 0) -> dict[str, str]:
    """A container's env as the kubelet sets it (the completion index from the pod's annotation)."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            if path == "status.podIP":  # the pod's address (METRICS_ADDR): here, this machine's loopback
                env[item["name"]] = "127.0.0.1"
                continue
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']", path
            env[item["name"]] = str(completion_index)
    return env


def node_only(env: dict[str, str], proxy: Proxy, tmp: Path) -> dict[str, str]:
    """What differs between a GPU node and this machine, nothing else."""
    return {**env, "STORAGE_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "STORAGE_ADDRESSING_STYLE": "path",
            "CHECKPOINT_DIR": str(tmp / "scratch/checkpoints"), "DATA_DIR": str(tmp / "scratch/datasets/current"),
            "NPROC_PER_NODE": "1", "METRICS_PORT": str(free_port()), "TRAIN_STEPS": str(STEPS)}


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A process with the container's environment and nothing of this machine's (no AWS
    credentials or config files a default chain could find instead)."""
    base = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "AWS_SHARED_CREDENTIALS_FILE": str(cwd / "none"),
            "AWS_CONFIG_FILE": str(cwd / "none")}
    return subprocess.run(command, env={**base, **env}, cwd=cwd, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)


def credentials_of(cloud: str, env: dict[str, str], meta: FakeMetadata, tmp: Path) -> dict[str, str]:
    """Where this group's trainer finds its credentials on a real node, pointed at the local server."""
    source = env["STORAGE_CREDENTIALS"]
    if source == "instance-role":  # ECS RAM / CVM CAM role (training/credentials.py)
        return {"GTS_METADATA_URL": meta.url}
    if source == "ack-rrsa":  # the projected service-account token, exchanged at Alibaba STS
        token = tmp / "rrsa-token"
        token.write_text("projected-sa-token")
        return {"ALIBABA_CLOUD_OIDC_TOKEN_FILE": str(token), "ALIBABA_CLOUD_STS_ENDPOINT": meta.url}
    if source == "tke-pod-identity":  # what TKE's pod-identity webhook sets, exchanged at Tencent STS
        token = tmp / "tke-token"
        token.write_text(meta.web_identity_token)
        return {"TKE_REGION": env["STORAGE_REGION"], "TKE_PROVIDER_ID": "cls-plan",
                "TKE_ROLE_ARN": "qcs::cam::uin/100000000001:roleName/pods", "TKE_WEB_IDENTITY_TOKEN_FILE": str(token),
                "GTS_STS_ENDPOINT": meta.url}
    assert source == "default" and cloud == "aws"
    if env.get("GTS_MODE") != "vm":
        # EKS Pod Identity: the agent's webhook adds these two variables to every pod of an
        # associated service account.
        token = tmp / "eks-pod-identity-token"
        token.write_text(meta.pod_identity_token)
        return {"AWS_CONTAINER_CREDENTIALS_FULL_URI": meta.url + POD_IDENTITY_PATH,
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": str(token)}
    return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": meta.url + "/"}  # botocore's IMDS client: the instance role


def _checkpoint_keys(server: MotoServer, url: str) -> list[str]:
    prefix = urllib.parse.urlsplit(url).path.lstrip("/")
    return [k.removeprefix(prefix) for k in server.keys(prefix)]


# ------------------------------------------------------------------------------ the contract

@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_group_hands_its_trainer_the_whole_contract(stack: str, tmp_path: Path) -> None:
    """Every variable of training/contract.py reaches every trainer, and the trainer's own config
    parser reads the stack's values from them."""
    spec = _spec(stack)
    found = 0
    for cloud, (type_token, name) in VM_NODES.items():
        if not any(r.name == name for r in shipped(stack)):
            continue
        env = vm_env(stack, cloud, tmp_path / cloud)
        assert contract.NAMES - {contract.NODE_RANK.name} <= set(env), sorted(contract.NAMES - set(env))
        _parses_as_the_stack_says(env, spec)
        found += 1
    for job in by_type(list(shipped(stack)), "kubernetes:batch/v1:Job"):
        env = container_env(job_containers(job)["trainer"])
        assert contract.NAMES <= set(env), sorted(contract.NAMES - set(env))
        _parses_as_the_stack_says(env, spec)
        found += 1
    assert found >= 3


def _parses_as_the_stack_says(env: dict[str, str], spec: StackSpec) -> None:
    cfg = config.parse([], environ=env)
    t = spec.training
    assert (cfg.workload, cfg.steps, cfg.checkpoint_every, cfg.keep) == (
        t.workload, t.steps, t.checkpoint_every, t.keep_checkpoints)
    assert cfg.checkpoint_url == env["CHECKPOINT_URL"] and cfg.checkpoint_url.endswith(f"/{env['GTS_NODE_GROUP']}/")
    assert cfg.data_dir == env["DATA_DIR"] and cfg.metrics_port == int(env["METRICS_PORT"])
    assert cfg.node_hourly_usd > 0


def test_the_docs_document_the_contract_as_the_code_defines_it() -> None:
    page = (ROOT / "docs" / "contract.md").read_text()
    assert contract.table() in page, "docs/contract.md's trainer contract table differs: paste training.contract.table()"


# ------------------------------------------------------------------ real runs, per cloud

def train_and_resume(env: dict[str, str], proxy: Proxy, meta: FakeMetadata, tmp: Path,
                     args: tuple[str, ...] = ()) -> None:
    """The image's entrypoint twice: STEPS steps with a checkpoint in the bucket, then, with the
    node's scratch gone (a new node), STEPS + 2 steps that resume from the bucket."""
    entrypoint = ["bash", str(ROOT / "training/node/entrypoint.sh"), *args]
    first = run(entrypoint, env, tmp)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert FINAL.search(first.stdout) and f"final step={STEPS} " in first.stdout
    shutil.rmtree(env["CHECKPOINT_DIR"])
    # A longer run than the checkpoint's changes its LR schedule: said explicitly, as a user would.
    second = run([*entrypoint, "--allow-config-change"], {**env, "TRAIN_STEPS": str(STEPS + 2)}, tmp)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from step {STEPS} " in second.stdout + second.stderr and f"final step={STEPS + 2} " in second.stdout
    assert proxy.signed_by == {meta.access_key()}, "every request signed with the group's own role"


@pytest.mark.parametrize("stack,cloud", [("dev", c) for c in sorted(VM_NODES)]
                         + [("prod", c) for c in sorted(VM_NODES)])
def test_a_vm_node_trains_and_resumes_with_the_env_its_user_data_gives_it(stack: str, cloud: str,
                                                                          tmp_path: Path) -> None:
    """Each VM group: the env file decoded from its launch template / scaling configuration, the
    entrypoint the image runs, checkpoints in that cloud's bucket scheme signed with the node's
    role, and a resume from the bucket. prod's ResNet-50 becomes the tiny workload (a CPU)."""
    env = vm_env(stack, cloud, tmp_path)
    bucket = urllib.parse.urlsplit(env["CHECKPOINT_URL"]).netloc
    server = MotoServer(bucket=bucket)
    proxy = Proxy(server.port)
    store = None
    try:
        with FakeMetadata(cloud) as meta:
            container = {**node_only(env, proxy, tmp_path), **credentials_of(cloud, env, meta, tmp_path),
                         "WORKLOAD": "tiny"}
            if int(env["NNODES"]) > 1:
                # A multi-node group: its nodes meet at the network's store instance (the plan's
                # address there); here the same store program on 127.0.0.1, this node alone.
                assert env["RDZV_ENDPOINT"] in _store_endpoints(stack), env["RDZV_ENDPOINT"]
                port = free_port()
                store = subprocess.Popen([str(BIN / "python"), "-m", "training.node.rdzv_store", "--port", str(port)],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                container.update(RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_LAST_CALL_S="1")
            train_and_resume(container, proxy, meta, tmp_path)
            assert meta.credential_requests >= 1
        keys = _checkpoint_keys(server, env["CHECKPOINT_URL"])
        assert f"step-{STEPS + 2:08d}/manifest-node000.json" in keys, keys
    finally:
        if store is not None:
            store.terminate()
            store.wait(timeout=10)
        proxy.down()
        server.stop()


def _store_endpoints(stack: str) -> set[str]:
    """host:port of every rendezvous store instance the plan creates (their fixed addresses)."""
    from infra.rendezvous import PORT

    found = set()
    for r in shipped(stack):
        if r.type in STORE_TYPES.values() and "-rdzv-" in r.name:
            found.add(f"{r.inputs.get('privateIp')}:{PORT}")
    return found


def _image_folder() -> dict[str, bytes]:
    from io import BytesIO

    from PIL import Image

    files = {}
    for label, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
        for i in range(4):
            buf = BytesIO()
            Image.new("RGB", (40 + 4 * i, 36), colour).save(buf, format="JPEG")
            files[f"{label}/{i}.jpg"] = buf.getvalue()
    return files


@pytest.mark.parametrize("cloud", sorted(JOBS))
def test_a_job_pod_caches_its_dataset_then_trains_and_resumes(cloud: str, tmp_path: Path) -> None:
    """prod's Kubernetes group on each cloud: the init container's command and the trainer
    container of the Job as the plan submits it, in order, with the pod's workload identity.
    The dataset lands on the pod's scratch; the trainer then runs the tiny workload (a CPU)."""
    containers = job_containers(registered("kubernetes:batch/v1:Job", JOBS[cloud]))
    trainer_env = container_env(containers["trainer"])
    bucket = urllib.parse.urlsplit(trainer_env["CHECKPOINT_URL"]).netloc
    server = MotoServer(bucket=bucket)
    proxy = Proxy(server.port)
    dataset = urllib.parse.urlsplit(trainer_env["DATASET_URL"])
    assert dataset.netloc == bucket, "the dataset is read from the group's own cloud's bucket"
    for rel, data in _image_folder().items():
        server.client().put_object(Bucket=bucket, Key=dataset.path.lstrip("/") + rel, Body=data)
    try:
        with FakeMetadata(cloud) as meta:
            identity = credentials_of(cloud, trainer_env, meta, tmp_path)
            init = containers["dataset"]
            env = {**node_only(container_env(init), proxy, tmp_path), **identity}
            command = [env["DATA_DIR"] if a == trainer_env["DATA_DIR"] else a for a in init["command"]]
            cached = run(command, env, tmp_path)
            assert cached.returncode == 0, cached.stdout[-2000:] + cached.stderr[-2000:]
            assert sorted(p.name for p in Path(env["DATA_DIR"]).iterdir()) == ["cat", "dog"]
            train_and_resume({**node_only(trainer_env, proxy, tmp_path), **identity, "WORKLOAD": "tiny"},
                             proxy, meta, tmp_path)
            if trainer_env["STORAGE_CREDENTIALS"] == "ack-rrsa":
                assert meta.oidc_tokens and set(meta.oidc_tokens) == {"projected-sa-token"}
            if trainer_env["STORAGE_CREDENTIALS"] == "tke-pod-identity":
                assert meta.web_identity_requests, "the pod's credentials came from STS, not the metadata service"
        keys = _checkpoint_keys(server, trainer_env["CHECKPOINT_URL"])
        assert f"step-{STEPS + 2:08d}/manifest-node000.json" in keys, keys
    finally:
        proxy.down()
        server.stop()


@pytest.mark.parametrize("bad,named", [
    ({"NNODES": "2", "RDZV_ENDPOINT": ""}, "NNODES=2 needs RDZV_ENDPOINT"),
    ({"STORAGE_CREDENTIALS": "access-keys"}, "STORAGE_CREDENTIALS='access-keys': use one of"),
    ({"NPROC_PER_NODE": "eight"}, "NPROC_PER_NODE='eight': a whole number"),
    ({"LAUNCHER": "deepspeed"}, "LAUNCHER='deepspeed': use one of torchrun, accelerate, horovod"),
    ({"NODE_RANK": "3", "NNODES": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK=3 is not below NNODES=2"),
])
def test_a_bad_contract_value_stops_the_container_before_any_launcher(bad: dict[str, str], named: str,
                                                                       tmp_path: Path) -> None:
    env = {**vm_env("dev", "aws", tmp_path), **bad}
    proc = run(["bash", str(ROOT / "training/node/entrypoint.sh")], env, tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"trainer contract: {proc.stderr.split(': ', 1)[1].strip()}"]
    assert named in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_number_names_its_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {**vm_env("dev", "aws", tmp_path), "CHECKPOINT_EVERY": "often"}
    with pytest.raises(SystemExit) as info:
        config.parse([], environ=env)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("the environment variable CHECKPOINT_EVERY='often': expected a whole number or auto")
    assert "usage:" not in err


def test_role_credentials_are_refreshed_before_they_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """Role credentials last hours on a node; a run lasts weeks. The trainer's storage layer
    takes new ones from the metadata service before the old expire (botocore's refresh windows:
    10 minutes ahead at the latest), so a rotated role key is used by the next request."""
    from training import storage

    server = MotoServer(bucket="gts-dev-ap-guangzhou-1250000000")
    proxy = Proxy(server.port)
    try:
        with FakeMetadata("tencentcloud", lifetime=300) as meta:  # inside the mandatory window
            for name, value in {"STORAGE_CREDENTIALS": "instance-role", "GTS_CLOUD": "tencentcloud",
                                "GTS_METADATA_URL": meta.url, "STORAGE_REGION": "ap-guangzhou",
                                "STORAGE_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
                                "STORAGE_ADDRESSING_STYLE": "path"}.items():
                monkeypatch.setenv(name, value)
            loc = storage.location("cosn://gts-dev-ap-guangzhou-1250000000/checkpoints/")
            loc.fs.pipe(loc.join("a"), b"1")
            meta.rotate()
            loc.fs.pipe(loc.join("b"), b"2")
            assert proxy.signed_by == {"STS.tencentcloud.0", "STS.tencentcloud.1"}
            meta.mode = "404"  # the role detached: a clear error, not a silent unsigned request
            with pytest.raises(MetadataError, match="cam/security-credentials/.* answered HTTP 404"):
                loc.fs.pipe(loc.join("c"), b"3")
    finally:
        proxy.down()
        server.stop()


# ------------------------------------------------------------- what the prod plan hands over

WRITES = re.compile(r"(?i)(put|delete|abort|multipart|\*$)")


def _statements(doc: dict[str, Any]) -> list[tuple[list[str], list[str]]]:
    out = []
    for st in doc.get("Statement") or doc.get("statement") or []:
        actions = st.get("Action", st.get("action", []))
        resources = st.get("Resource", st.get("resource", []))
        out.append(([actions] if isinstance(actions, str) else actions,
                    [resources] if isinstance(resources, str) else resources))
    return out


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_bucket_write_is_to_one_groups_checkpoints(stack: str) -> None:
    """Least privilege on every cloud: no identity writes datasets/ or nodes/, and each writes
    one checkpoint prefix — its own group's."""
    import json

    policies = {"aws:iam/rolePolicy:RolePolicy": "policy", "alicloud:ram/policy:Policy": "policyDocument",
                "tencentcloud:Cam/policy:Policy": "document"}
    groups = {g["name"] for g in stack_values(stack)["gpu-training-stack:nodeGroups"]}
    writers = 0
    for r in shipped(stack):
        if r.type not in policies or not r.name.endswith("-bucket"):
            continue
        doc = json.loads(r.inputs[policies[r.type]])
        written = {res for actions, resources in _statements(doc) if any(WRITES.search(a) for a in actions)
                   for res in resources if "kms" not in res and not res.startswith("acs:kms")}
        prefixes = {re.search(r"checkpoints/([^/]+)/", res).group(1) if "checkpoints/" in res else res  # type: ignore[union-attr]
                    for res in written}
        assert all(p in groups for p in prefixes), (r.name, written)
        assert len(prefixes) <= 1, (r.name, prefixes)
        writers += bool(prefixes)
        if prefixes:
            assert next(iter(prefixes)) in r.name, f"{r.name} writes another group's checkpoints: {prefixes}"
    assert writers >= 3


def test_no_node_or_job_runs_a_bare_base_image(tmp_path: Path) -> None:
    """Every VM's trainer image and every Job container is the stack's build, by digest, in the
    group's own cloud's registry (the mocks' registry addresses), never the NGC base."""
    res = list(shipped("prod"))
    base = stack_values("prod")["gpu-training-stack:training"]["image"].split("@")[0]
    built = {p.type.split(":")[1]: p.outputs["trainerImage"] for p in res if p.type.endswith(":Platform")}
    cloud_of = {g["name"]: g["cloud"] for g in stack_values("prod")["gpu-training-stack:nodeGroups"]}
    assert len(set(built.values())) == 3 and all("@sha256:" in ref and not ref.startswith(base) for ref in built.values())
    for job in by_type(res, "kubernetes:batch/v1:Job"):
        cloud = cloud_of[job.name.removesuffix("-job")]
        assert {c["image"] for c in job_containers(job).values()} == {built[cloud]}, job.name
    for cloud, (type_token, name) in VM_NODES.items():
        root = tmp_path / name
        lay_down(user_data(type_token, name, ("userData",)), root)
        assert node_env(root)["GTS_IMAGE"] == built[cloud], name


def test_jobs_are_hardened_and_sized_from_their_node_type() -> None:
    res = list(shipped("prod"))
    (ns,) = [n for n in by_type(res, "kubernetes:core/v1:Namespace") if n.inputs["metadata"]["name"] == "training"][:1]
    assert ns.inputs["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for job in by_type(res, "kubernetes:batch/v1:Job"):
        pod = job.inputs["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
        for c in job_containers(job).values():
            sc = c["securityContext"]
            assert (sc["runAsNonRoot"], sc["allowPrivilegeEscalation"], sc["capabilities"]["drop"],
                    sc["seccompProfile"]["type"]) == (True, False, ["ALL"], "RuntimeDefault"), (job.name, c["name"])
            assert c["resources"]["requests"] == c["resources"]["limits"], (job.name, c["name"])
        trainer = job_containers(job)["trainer"]
        assert "command" not in trainer and "args" not in trainer, "the image's entrypoint runs"
        mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
        env = container_env(trainer)
        assert env["CHECKPOINT_DIR"].startswith(mounts["scratch"] + "/") and env["DATA_DIR"].startswith(mounts["scratch"])
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        assert int(shm.removesuffix("Gi")) < int(trainer["resources"]["limits"]["memory"].removesuffix("Gi"))


def test_make_dataset_copies_the_dataset_into_every_clouds_bucket(tmp_path: Path) -> None:
    """The operator's command, run from a copy of the project on a stack that names a dataset:
    every cloud with nodes gets datasets/<name>/ in its own bucket (where its nodes' roles read
    it); a second run copies nothing; missing cloud keys are named before anything is copied."""
    import sys

    from tests.harness import key, project_copy, write_stack

    proj = project_copy(tmp_path)
    source = tmp_path / "imgs"
    for rel, data in _image_folder().items():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes(data)
    values = stack_values("dev")
    values[key("training")].update(dataset="pets", datasetSource=str(source))
    write_stack(proj, "team-a", values)
    spec = parse_spec(spec_raw(values))
    server = MotoServer(bucket="unused")
    try:
        from infra.buckets import bucket as bucket_of

        names = {cloud: bucket_of(spec, cloud).name for cloud in ("aws", "alicloud", "tencentcloud")}
        for name in names.values():
            server.client().create_bucket(Bucket=name)
        command = [sys.executable, "-m", "infra.cli.dataset", "--stack", "team-a", "--workers", "4",
                   *[f"--endpoint={cloud}={server.url}" for cloud in names]]
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(proj), "HOME": str(tmp_path),
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "ALICLOUD_ACCESS_KEY": "ak", "TENCENTCLOUD_SECRET_ID": "id", "TENCENTCLOUD_SECRET_KEY": "sk"}
        refused = subprocess.run(command, cwd=proj, env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "ALICLOUD_ACCESS_KEY and ALICLOUD_SECRET_KEY" in refused.stderr
        assert all(not server.keys_in(b) for b in names.values()), "nothing copied before the keys are all there"
        env["ALICLOUD_SECRET_KEY"] = "sk"
        first = subprocess.run(command, cwd=proj, env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        assert first.stdout.count("8 of 8 files copied") == 3, first.stdout
        for name in names.values():
            assert server.keys_in(name) == sorted(f"datasets/pets/{rel}" for rel in _image_folder())
        again = subprocess.run(command, cwd=proj, env=env, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and again.stdout.count("0 of 8 files copied") == 3, again.stdout
    finally:
        server.stop()


@pytest.mark.parametrize("cloud", sorted(STORE_TYPES))
def test_the_rendezvous_store_instance_boots_into_the_store_its_nodes_name(cloud: str, tmp_path: Path) -> None:
    """Each prod network with a multi-node VM group gets one store instance at its fixed
    address, created before the group's nodes (which may not take the address), booting with
    GTS_MODE=rendezvous and the same trainer image; its user data decodes like a node's."""
    res = list(shipped("prod"))
    (store,) = [r for r in by_type(res, STORE_TYPES[cloud]) if "-rdzv-" in r.name]
    env = vm_env("prod", cloud, tmp_path / "node")
    assert env["RDZV_ENDPOINT"] == f"{store.inputs['privateIp']}:29400"
    root = tmp_path / "store"
    field = "userDataBase64" if cloud == "aws" else "userData"
    lay_down(user_data(STORE_TYPES[cloud], store.name, (field,)), root)
    store_env = node_env(root)
    assert store_env["GTS_MODE"] == "rendezvous" and store_env["GTS_IMAGE"] == env["GTS_IMAGE"]
    assert store_env["GTS_BUNDLE_SHA256"] == env["GTS_BUNDLE_SHA256"]
    assert store.options["deleteBeforeReplace"], "one fixed address: the old store goes first"
    # What starts nodes (launch template / scaling group / configuration / instances); the group's
    # replace-self IAM policy (GPU health) starts none and need not wait for the store.
    fleet_children = [r for r in res if r.parent and f"GpuFleet::{env['GTS_NODE_GROUP']}" in r.parent
                      and not re.search(r"(?i)polic", r.type)]
    assert fleet_children and all(store.urn in r.options["dependencies"] for r in fleet_children), \
        "the group's nodes start only after the store holds its address"
