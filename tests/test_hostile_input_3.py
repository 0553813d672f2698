"""Flags, make variables, the environment and the files around a stack tried as a careless user
would (issue 48): each answered with exit 2 and one line naming it, never a traceback, a hang
or a file written where the user did not say. The stack file's own YAML is
tests/test_hostile_input_2.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, project_copy
from training.trainer import failure
from training.trainer.config import storage_problem
from tests.teams_helpers import make_teams, teams_project
from tests.test_hostile_input import _plan

TODAY = "2026-11-30"


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------ stack "files" that are not files

def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # opened for reading, it would wait for a writer forever


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")  # read, it would fill the memory


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere.yaml")


def _latin1(path: Path) -> None:
    path.write_bytes(b"config:\n  gpu-training-stack:env: dev\n  gpu-training-stack:tags: {owner: caf\xe9}\n")


@pytest.mark.parametrize("make,says", [
    (_directory, "Pulumi.odd.yaml is a directory"), (_fifo, "Pulumi.odd.yaml is not a regular file"),
    (_device, "Pulumi.odd.yaml is not a regular file"), (_dangling, "Pulumi.odd.yaml: is a link to a missing file"),
    (_latin1, "Pulumi.odd.yaml, line 3: byte 0xe9 is not UTF-8")])
def test_a_stack_file_that_is_not_one_is_named_without_being_read(tmp_path: Path, make: object, says: str) -> None:
    proj = project_copy(tmp_path)
    make(proj / "Pulumi.odd.yaml")  # type: ignore[operator]
    proc = _plan(proj, "odd", GTS_TODAY=TODAY)  # its timeout is the hang detector for the FIFO
    assert proc.returncode == 2 and says in _one_line(proc.stderr), proc.stderr


def test_make_teams_goes_on_past_an_unreadable_stack_file_and_names_it(tmp_path: Path) -> None:
    """One bad stack file anywhere broke `make teams` for every team (a date was an internal
    error); now a date is text, and a file that cannot be read is named in a warning while the
    teams' report goes on, as the registry's bucket check already skipped it."""
    proj = teams_project(tmp_path)
    (proj / "Pulumi.dated.yaml").write_text("config:\n  gpu-training-stack:tags: {owner: 2026-01-01}\n")
    (proj / "Pulumi.tagged.yaml").write_text("config:\n  gpu-training-stack:tags: {owner: !!binary aGVsbG8=}\n")
    proc = make_teams(proj, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert {t["team"] for t in json.loads(proc.stdout)["teams"]} >= {"vision", "nlp", "speech"}
    [warning] = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert "Pulumi.tagged.yaml, line 2: config.gpu-training-stack:tags.owner: the tag !!binary" in warning
    assert "make teams goes on without it" in warning and "internal error" not in proc.stderr


# ------------------------------------------------------------------ the environment and flags of make plan

@pytest.mark.parametrize("today", ["garbage", "2026-02-30", "30/11/2026"])
def test_a_bad_gts_today_is_named(tmp_path: Path, today: str) -> None:
    proj = project_copy(tmp_path)
    (proj / "Pulumi.dev.yaml").write_text((ROOT / "Pulumi.dev.yaml").read_text())
    proc = _plan(proj, "dev", GTS_TODAY=today)
    assert proc.returncode == 2 and proc.stdout == ""
    assert _one_line(proc.stderr).startswith(f"error: GTS_TODAY={today!r} is not a date")


@pytest.mark.parametrize("content,says", [
    ("not json", "is not JSON"), ('{"a": 1}', "is JSON but not a plan"), ("[1, 2]", "is JSON but not a plan"),
    ('{"resources": [{"urn": 1}]}', "is JSON but not a plan"), (None, "is not a file"), (b"\xff\xfe", "is not JSON")])
def test_against_a_file_that_is_not_a_plan_is_named(tmp_path: Path, content: str | bytes | None, says: str) -> None:
    proj = project_copy(tmp_path)
    (proj / "Pulumi.dev.yaml").write_text((ROOT / "Pulumi.dev.yaml").read_text())
    against = tmp_path / "earlier.json"
    if content is None:
        against.mkdir()
    elif isinstance(content, bytes):
        against.write_bytes(content)
    else:
        against.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", "dev", "--against", str(against)], cwd=proj,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": TODAY})
    assert proc.returncode == 2 and f"--against {against}: {says}" in _one_line(proc.stderr)


@pytest.mark.parametrize("module", ["infra.cli.userdata", "infra.cli.monitoring", "infra.cli.policy_config"])
def test_an_out_folder_that_cannot_be_written_is_named(tmp_path: Path, module: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "out"
    proc = subprocess.run([sys.executable, "-m", module, "--stack", "dev", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "GTS_TODAY": TODAY})
    assert proc.returncode == 2 and proc.stdout == ""
    assert _one_line(proc.stderr) == f"error: OUT={out}: cannot write there (Not a directory); pass OUT=<a folder you can write>"


def test_make_diff_without_git_says_so(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with python but no git
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    proc = subprocess.run([sys.executable, "-m", "infra.cli.diff", "--base", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": str(bin_dir)})
    assert proc.returncode == 2 and "git is not installed" in _one_line(proc.stderr)


# ------------------------------------------------------------------ the trainer's checkpoint folder and URL

@pytest.mark.parametrize("flag,value,says", [
    ("--checkpoint-dir", "", "is empty, which would be the current directory"),
    ("--checkpoint-dir", "::::", "holds ':' but is not a URL"),
    ("--checkpoint-dir", "ftp://host/x", "ftp:// is not a storage the trainer writes"),
    ("--checkpoint-url", "gs://bucket/x", "gs:// is not a storage the trainer writes"),
    ("--checkpoint-url", "s3://", "names no bucket; write s3://<bucket>/<path>"),
    ("--checkpoint-dir", "oss:///x", "names no bucket"),
    ("--checkpoint-dir", "file://", "names no folder"),
    ("--checkpoint-url", "file://ckpts", "names the host 'ckpts', which a file:// URL cannot reach"),
    ("--checkpoint-url", "file://host/p", "names the host 'host'"),
    ("--checkpoint-dir", "ftp:x", "ftp:// is not a storage the trainer writes"),
    ("--checkpoint-dir", "run:3", "run:// is not a storage the trainer writes; use s3://, oss://, cosn://, file:// or "
                                "a path (for a folder write ./run:3)"),
    ("--checkpoint-dir", "s3:bucket", "is not a URL: write s3://<bucket>/<path>")])
def test_checkpoint_places_that_cannot_work_are_refused(tmp_path: Path, flag: str, value: str, says: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "training.trainer.config", "--workload", "tiny", flag, value],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and f"{flag}={value!r}: {says}" in _one_line(proc.stderr)
    assert not list(tmp_path.iterdir())  # nothing written in the current directory


@pytest.mark.parametrize("value", ["/mnt/nvme/ckpt/run-2026-01-01T10:00", "out/run:3", "./run:3", "S3://bucket/p",
                                   "file:///tmp/x", "file://localhost/tmp/x"])
def test_checkpoint_places_with_a_colon_or_capitals_that_work_are_taken(value: str) -> None:
    assert storage_problem(value, empty_ok=False) == ""


def test_make_train_local_with_an_empty_checkpoint_dir_writes_nothing(tmp_path: Path) -> None:
    before = set(os.listdir(ROOT))
    proc = subprocess.run(["make", "-s", "train-local", "CKPT_DIR=", "STEPS=2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "--checkpoint-dir='': is empty" in proc.stderr, proc.stderr
    assert set(os.listdir(ROOT)) == before and not (ROOT / ".lock").exists()


def test_a_workers_fault_is_the_entrypoints_last_line(tmp_path: Path) -> None:
    """torchrun's ChildFailedError report names no cause: the worker's one line comes last."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "LAUNCHER": "torchrun",
           "NNODES": "1", "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("STORAGE_REGION", None)
    env.pop("STORAGE_ENDPOINT_URL", None)
    proc = subprocess.run(["bash", str(ROOT / "training/node/entrypoint.sh"), "--workload", "tiny", "--steps", "4",
                           "--checkpoint-dir", "oss://bucket/run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("entrypoint: the trainer failed (exit 1): ValueError: oss:// needs STORAGE_REGION"), last


def test_the_failure_line_is_the_last_attempts_not_a_restarted_ones(tmp_path: Path) -> None:
    """The failure file outlives torchrun's restarts: the first attempt's fault was printed."""
    (tmp_path / "flaky.py").write_text(
        "import os\nfrom training.trainer import failure\n"
        "def main() -> int:\n"
        "    raise RuntimeError('attempt ' + os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "failure.noted(main)\n")
    # torchrun restarts as the multi-node launch does (--max-restarts); the entrypoint reads the
    # file with this module (its own last line is test_a_workers_fault_is_the_entrypoints_last_line).
    faults = tmp_path / "faults"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{tmp_path}", "GTS_FAILURE_FILE": str(faults)}
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "-m", "flaky"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "attempt 0" in faults.read_text()  # the first attempt did fail
    said = subprocess.run([sys.executable, "-m", "training.trainer.failure", str(faults)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert said.stdout.strip() == "RuntimeError: attempt 1", said


def test_a_failure_file_that_cannot_be_written_leaves_the_workers_error(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTS_FAILURE_FILE", str(tmp_path))  # a folder: open() raises IsADirectoryError

    def main() -> int:
        raise ValueError("the real fault")

    with pytest.raises(ValueError, match="the real fault"):
        failure.noted(main)
