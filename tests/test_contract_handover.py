"""What the prod plan hands its nodes and Jobs besides the trainer contract: every bucket write
grant is to one group's checkpoints, no node or Job runs the bare base image, Jobs are hardened
and sized from their node type, each multi-node VM network's rendezvous store instance boots into
the store its nodes name, and `make dataset` copies a dataset into every cloud's bucket."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.contract_helpers import STORE_TYPES, VM_NODES, _image_folder, container_env, job_containers, vm_env
from tests.harness import parse_spec
from tests.harness import by_type, shipped, spec_raw, stack_values
from tests.nodes import lay_down, node_env, user_data
from tests.training_helpers import MotoServer


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
