"""Training code we did not write, on the stack: a plain PyTorch loop that uses only the
checkpoint library, the guide's BERT fine-tuning under `accelerate launch` through the
Hugging Face callback — both interrupted with SIGTERM and resumed, compared with uninterrupted
runs — and a stack's own command and image, rendered into the VM node service and the Job
alike and checked before anything is created."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra.core.errors import SpecError
from infra.plan.engine import Registered
from tests.harness import parse_spec
from tests.harness import ROOT, by_type, run_stack, spec_raw, stack_values
from tests.contract_helpers import JOBS, VM_NODES, container_env, job_containers, node_env_of
from tests.training_helpers import BIN, FAULT_ENV, LAUNCH_TIMEOUT, MotoServer, Run, free_port, storage_env
from training import contract

EXAMPLE = ROOT / "examples" / "plain_loop.py"
BERT = ["-m", "training.trainer.workloads.bert_finetune", "--output_dir", "${CHECKPOINT_DIR}/hf-out", "--max_steps", "36",
        "--sleep_ms", "120"]


def start(command: list[str], env: dict[str, str], cwd: Path) -> Run:
    base = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", **FAULT_ENV}
    proc = subprocess.Popen(command, cwd=cwd, env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = Run(proc)
    run.start_reader()
    return run


def final_line(run: Run) -> str:
    line = next((x for x in run.lines if x.startswith("final step=")), None)
    assert line, f"no final line:\n{run.output[-3000:]}"
    return line


# ------------------------------------------------------------------ a plain loop, the library only

def test_a_plain_loop_resumes_exactly_after_sigterm(tmp_path: Path) -> None:
    args = [str(BIN / "python"), str(EXAMPLE), "--steps", "150", "--checkpoint-every", "40"]
    reference = start(args + ["--checkpoint-dir", str(tmp_path / "ref")], {}, tmp_path)
    assert reference.finish() == 0, reference.output[-3000:]

    ckpt = str(tmp_path / "run")
    first = start(args + ["--checkpoint-dir", ckpt, "--sleep-ms", "25", "--pause-at", "60"], {}, tmp_path)
    first.wait_for(r"committed checkpoint step-00000040")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    stopped = first.wait_for(r"stopped by SIGTERM at step \d+")
    assert "final step=" not in first.output
    assert not stopped.endswith("step 150")

    second = start(args + ["--checkpoint-dir", ckpt], {}, tmp_path)
    assert second.finish() == 0, second.output[-3000:]
    second.wait_for(r"resumed from checkpoint step (4[1-9]|[5-9]\d|1[0-4]\d)\b")
    assert final_line(second) == final_line(reference)


def test_the_library_reads_its_settings_from_the_contract(tmp_path: Path) -> None:
    """CHECKPOINT_DIR and CHECKPOINT_EVERY from the environment the stack gives a node."""
    env = {contract.CHECKPOINT_DIR.name: str(tmp_path / "ck"), contract.CHECKPOINT_EVERY.name: "25"}
    run = start([str(BIN / "python"), str(EXAMPLE), "--steps", "60"], env, tmp_path)
    assert run.finish() == 0, run.output[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-00000025", "step-00000050",
                                                                       "step-00000060"]


# ------------------------------------------------------------------ the stack's own command

def with_command(command: list[str], launcher: str = "accelerate", every: int = 12):  # type: ignore[no-untyped-def]
    """The stack runs `command` under `launcher`; accelerate runs one node per run, so the VM
    groups do too."""
    def edit(values: dict[str, Any]) -> None:
        training = values["gpu-training-stack:training"]
        training.update({"command": command, "launcher": launcher, "checkpointEvery": every})
        if launcher != "torchrun":
            for group in values["gpu-training-stack:nodeGroups"]:
                if group.get("kind", "vm") == "vm":
                    group["scaling"] = {"min": 1, "max": 1, "desired": 1}
                    group["market"] = {"type": "spot"}
                    group.pop("schedule", None)
    return edit


def job_trainer(resources: list[Registered], cloud: str) -> dict[str, Any]:
    job = next(r for r in resources if r.name == JOBS[cloud])
    return job_containers(job)["trainer"]


@pytest.fixture(scope="module")
def bert_stack(tmp_path_factory: pytest.TempPathFactory) -> list[Registered]:
    return run_stack("prod", with_command(BERT), tmp_path_factory.mktemp("bert-stack"))


@pytest.mark.parametrize("cloud", sorted(VM_NODES))
def test_a_user_command_reaches_the_vm_service_and_the_job_alike(bert_stack: list[Registered], cloud: str,
                                                                  tmp_path: Path) -> None:
    vm, job = node_env_of(bert_stack, cloud, tmp_path), container_env(job_trainer(bert_stack, cloud))
    assert vm[contract.TRAIN_COMMAND.name] == job[contract.TRAIN_COMMAND.name]
    assert contract.decode_command(vm[contract.TRAIN_COMMAND.name]) == BERT
    assert vm[contract.LAUNCHER.name] == job[contract.LAUNCHER.name] == "accelerate"
    # the env file stays readable by bash (the node scripts source it), systemd and docker alike
    assert all(ch.isalnum() or ch in "-_=" for ch in vm[contract.TRAIN_COMMAND.name])


def test_the_bert_finetuning_resumes_from_the_bucket_with_the_same_loss(bert_stack: list[Registered],
                                                                         tmp_path: Path) -> None:
    """The aws VM node's env, as its user data writes it, run through the image's entrypoint with
    two CPU processes under accelerate; SIGTERM mid-run; the node is then lost (its disk with
    it) and a new one resumes from the S3 server."""
    plan_env = node_env_of(bert_stack, "aws", tmp_path)
    server = MotoServer(bucket=plan_env["CHECKPOINT_URL"].split("/")[2])
    try:
        def node(scratch: str, url: str) -> dict[str, str]:
            return {**plan_env, **storage_env(server.url), "CHECKPOINT_URL": url, "ACCELERATE_USE_CPU": "1",
                    "CHECKPOINT_DIR": str(tmp_path / scratch), "NPROC_PER_NODE": "2", "NNODES": "1",
                    "MIN_NNODES": "1", "RDZV_ENDPOINT": "", "METRICS_PORT": str(free_port())}

        entrypoint = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]
        reference = start(entrypoint, node("ref", ""), tmp_path)
        assert reference.finish(LAUNCH_TIMEOUT) == 0, reference.output[-3000:]

        first = start(entrypoint, node("node-a", plan_env["CHECKPOINT_URL"]), tmp_path)
        first.wait_for(r"checkpoint step 12 committed", timeout=120)
        os.kill(first.proc.pid, signal.SIGTERM)
        assert first.finish(LAUNCH_TIMEOUT) == 0, first.output[-3000:]
        stopped = int(first.wait_for(r"stopping at step (\d+)").split("stopping at step ")[1].split()[0])
        assert 12 <= stopped < 36
        shutil.rmtree(tmp_path / "node-a")  # the reclaimed node's disk is gone
        prefix = plan_env["CHECKPOINT_URL"].split("/", 3)[3]
        assert any(k.endswith(f"step-{stopped:08d}/manifest-node000.json") for k in server.keys_in(
            plan_env["CHECKPOINT_URL"].split("/")[2], prefix))

        second = start(entrypoint, node("node-b", plan_env["CHECKPOINT_URL"]), tmp_path)
        assert second.finish(LAUNCH_TIMEOUT) == 0, second.output[-3000:]
        second.wait_for(rf"resuming the Trainer from checkpoint step {stopped}\b")
        assert final_line(second) == final_line(reference)
    finally:
        server.stop()


# ------------------------------------------------------------------ validation

def _problems(edit: Any) -> str:
    values = stack_values("dev")
    edit(values)
    with pytest.raises(SpecError) as err:
        parse_spec(spec_raw(values))
    return str(err.value)


@pytest.mark.parametrize("command, named", [
    (["-m", "training.trainer.workloads.bert_finetune", "--data", "${DATA_DIR}"], "training.command[3]: "),
    (["train.py", "--run", "${RUN_NAME}"], "${RUN_NAME} is not a trainer-contract variable"),
    (["train.py", "--tracking", "${MLFLOW_TRACKING_URI}"], "training.mlflowTrackingUri"),
    (["-m", "not a module"], "training.command[1]: after '-m' comes a Python module name"),
    (["-c", "print(1)"], "training.command[0]: '-c': the command starts with a script"),
    (["train.py", "--rank", "${NODE_RANK}"], "it needs a Kubernetes group (the Job sets it"),
    (["train.py", "--out", "${SHARED_DIR}/run"], "it needs sharedFs: true on the group"),
    (["train.py", "a\x00b"], "an argument cannot hold a NUL character"),
])
def test_a_command_that_needs_what_the_stack_lacks_is_refused(command: list[str], named: str) -> None:
    assert named in _problems(with_command(command))


def test_a_group_image_must_be_pinned_and_not_shadowed() -> None:
    def edit(values: dict[str, Any]) -> None:
        values["gpu-training-stack:nodeGroups"][0]["training"] = {"image": "ghcr.io/team/trainer:latest"}
    assert "nodeGroups[0].training.image: 'ghcr.io/team/trainer:latest' is not pinned by digest" in _problems(edit)


def test_a_group_gets_its_own_image_and_command(tmp_path: Path) -> None:
    """prod's aws-eks-train group with its own base image and command; aws-train keeps the stack's."""
    base = "ghcr.io/team/bert@sha256:" + "a" * 64
    own = ["-m", "team.train", "--epochs", "3"]

    def edit(values: dict[str, Any]) -> None:
        (group,) = [g for g in values["gpu-training-stack:nodeGroups"] if g["name"] == "aws-eks-train"]
        group["training"] = {"image": base, "command": own}
    resources = run_stack("prod", edit, tmp_path)
    built = {r.inputs["buildArgs"]["BASE_IMAGE"]: r for r in by_type(resources, "docker-build:index:Image")
             if "aws" in r.name}
    assert len(built) == 2 and base in built, "one more trainer image on AWS, built on the group's base"
    trainer = job_trainer(resources, "aws")
    vm = node_env_of(resources, "aws", tmp_path)
    assert contract.decode_command(container_env(trainer)[contract.TRAIN_COMMAND.name]) == own
    assert vm[contract.TRAIN_COMMAND.name] == ""
    assert trainer["image"] != vm["GTS_IMAGE"]
    assert trainer["image"].split("@")[0] == vm["GTS_IMAGE"].split("@")[0], "the same repository, another digest"


def test_the_library_follows_checkpoint_every_auto(tmp_path: Path) -> None:
    """CHECKPOINT_EVERY=auto, as dev's stack hands it: Daly's interval from MTBF_S and the
    measured costs, logged, and checkpoints taken by it (a short MTBF makes them frequent)."""
    env = {contract.CHECKPOINT_DIR.name: str(tmp_path / "ck"), contract.CHECKPOINT_EVERY.name: "auto",
           contract.MTBF_S.name: "2", contract.NOTICE_S.name: "0"}
    run = start([str(BIN / "python"), str(EXAMPLE), "--steps", "200", "--sleep-ms", "10"], env, tmp_path)
    assert run.finish() == 0, run.output[-3000:]
    line = run.wait_for(r"checkpoint interval: every \d+ steps")
    assert "Daly (FGCS 2006)" in line and "M=2 s" in line
    assert len(list((tmp_path / "ck").glob("step-*"))) == 3  # keep-K of the many it took
    assert (tmp_path / "ck" / "step-00000200").is_dir()


def test_the_library_reads_the_interval_a_dev_node_is_given(tmp_path: Path) -> None:
    """The seam plan -> node env -> library: dev's AWS VM node env, decoded from its user data
    (checkpointEvery: auto, MTBF_S and NOTICE_S from infra/data/interruptions.yaml), given to a
    loop that uses only the library; only the bucket (out of reach here) and scratch are replaced."""
    from tests.contract_helpers import vm_env

    env = vm_env("dev", "aws", tmp_path)
    assert env[contract.CHECKPOINT_EVERY.name] == "auto"
    node = {**env, contract.CHECKPOINT_URL.name: "", contract.CHECKPOINT_DIR.name: str(tmp_path / "scratch")}
    run = start([str(BIN / "python"), str(EXAMPLE), "--steps", "40"], node, tmp_path)
    assert run.finish() == 0, run.output[-3000:]
    line = run.wait_for(r"checkpoint interval: every \d+ steps")
    assert f"M={env[contract.MTBF_S.name]} s" in line
    assert f"a {env[contract.NOTICE_S.name]} s notice covers a durable checkpoint" in line


def test_fsdp_asked_of_accelerate_on_cpu_is_named_not_silently_ddp(tmp_path: Path) -> None:
    """`accelerate launch --use_fsdp --fsdp_version 2` on CPU: accelerate (1.15) runs it as
    MULTI_CPU (DDP) without a word; the callback says so, and the checkpoint it commits holds the
    whole model (a replicated one, no FSDP shard folders)."""
    env = {"ACCELERATE_USE_CPU": "1", contract.CHECKPOINT_DIR.name: str(tmp_path / "ck"),
           contract.CHECKPOINT_EVERY.name: "4"}
    command = [str(BIN / "accelerate"), "launch", "--num_processes", "2", "--num_machines", "1",
               "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
               "--use_fsdp", "--fsdp_version", "2", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
               "-m", "training.trainer.workloads.bert_finetune", "--output_dir", str(tmp_path / "out"), "--max_steps", "4"]
    run = start(command, env, tmp_path)
    assert run.finish(LAUNCH_TIMEOUT) == 0, run.output[-3000:]
    line = run.wait_for(r"FSDP was asked for \(accelerate launch --use_fsdp\) but accelerate runs this as ")
    assert "as MULTI_CPU:" in line, line
    assert final_line(run).startswith("final step=4 ")
    files = sorted(p.name for p in (tmp_path / "ck" / "step-00000004").iterdir())
    assert "model.safetensors" in files and not any("fsdp" in name for name in files), files
