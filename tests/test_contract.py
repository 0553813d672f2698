"""The seam stack -> training container. What the plan hands a trainer — a VM node's env file
decoded from its real user data, a Kubernetes Job's container env — is fed, as it is, to the
real trainer (training/node/entrypoint.sh, torchrun, gloo on CPU) against an S3 server on 127.0.0.1,
with the credentials each group's nodes really have: the instance role from a local metadata
server in the cloud's format, EKS Pod Identity, ACK RRSA (an STS exchange of the pod's token)
or the TKE node's CAM role. A proxy in front of the bucket notes which access key signed each
request, so the test proves the role's credentials were used, not some default.

Only what a node has and this machine has not is replaced (`node_only`): the bucket's address
and addressing style, scratch paths, GPUs, ports, the metadata and STS addresses; and prod's
ResNet-50 on ImageNet becomes the tiny workload, which a CPU trains in seconds.

What else the prod plan hands over (bucket grants, images, Job hardening, the rendezvous store
instance, `make dataset`) is tests/test_contract_handover.py."""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from infra.model.spec import StackSpec
from tests.contract_helpers import JOBS, STORE_TYPES, VM_NODES, _image_folder, container_env, job_containers, vm_env
from tests.harness import parse_spec
from tests.harness import ROOT, by_type, shipped, spec_raw, stack_values
from tests.metadata_server import POD_IDENTITY_PATH, FakeMetadata
from tests.nodes import registered
from tests.training_helpers import BIN, FINAL, LAUNCH_TIMEOUT, MotoServer, Proxy, free_port
from training import contract
from training.cloudmeta import MetadataError
from training.trainer import config


STEPS = 3


def _spec(stack: str) -> StackSpec:
    return parse_spec(spec_raw(stack_values(stack)))


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
        vm_names = contract.NAMES - {contract.NODE_RANK.name, contract.SPARES.name}  # a Job's alone
        assert vm_names <= set(env), sorted(vm_names - set(env))
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
                # Its key: where node.env says the cloud's secret store holds it, the value the plan
                # puts there (gts-rdzv-key.py reads it so at boot: tests/test_rdzv_key_fetch.py).
                container.update(RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_LAST_CALL_S="1",
                                 RDZV_KEY=_stored_key(stack, env["GTS_RDZV_KEY_REF"]))
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


SECRET_VALUES = {"aws:ssm/parameter:Parameter": ("name", "value"),
                 "alicloud:oos/secretParameter:SecretParameter": ("secretParameterName", "value"),
                 "tencentcloud:Ssm/secretVersion:SecretVersion": ("secretName", "secretString")}


def _stored_key(stack: str, ref: str) -> str:
    """The value of the plan's secret named `ref` (an SSM parameter, OOS secret parameter or SSM secret)."""
    from infra.plan.engine import unwrap_secrets

    found = [unwrap_secrets(r.inputs)[SECRET_VALUES[r.type][1]] for r in shipped(stack)
             if r.type in SECRET_VALUES and unwrap_secrets(r.inputs)[SECRET_VALUES[r.type][0]] == ref]
    assert len(found) == 1, (ref, found)
    return str(found[0])


def _store_endpoints(stack: str) -> set[str]:
    """host:port of every rendezvous store instance the plan creates (their fixed addresses)."""
    from infra.rendezvous import PORT

    found = set()
    for r in shipped(stack):
        if r.type in STORE_TYPES.values() and "-rdzv-" in r.name:
            found.add(f"{r.inputs.get('privateIp')}:{PORT}")
    return found


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
    from training.ckpt import storage

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
