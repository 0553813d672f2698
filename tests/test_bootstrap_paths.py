"""The node bootstrap along whole paths: a reclaim notice that ends in a committed checkpoint
(torchrun, the spot watcher, a 35 s emergency checkpoint), the rendezvous store's own user data
through the bootstrap, and the defects the real boot found (#29) — the dataset copy's entrypoint,
units that start the trainer again, apt's silent update failure, the signal the docs name."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.bootstrap_helpers import ROOT, _bootstrap, _calls, _node_env, make_sandbox
from training import cloudmeta


@pytest.fixture()
def sandbox(tmp_path: Path) -> dict[str, str]:
    """The node's scripts and their stand-ins (tests/bootstrap_helpers.py), one per test."""
    return make_sandbox(tmp_path)


# --------------------------------------------------------------- the spot path, end to end

def test_a_reclaim_notice_ends_in_a_committed_checkpoint_even_when_it_takes_over_30s(tmp_path: Path) -> None:
    """The trainer launched as the node's container launches it (training/node/entrypoint.sh: torchrun),
    a local metadata server announces the reclaim, and the watcher signals the workers. Their
    emergency checkpoint takes 35 s — longer than torchrun's 30 s between forwarding SIGTERM and
    SIGKILL — yet it commits, torchrun exits 0, and the watcher logs how long it took."""
    import json
    import sys
    import time

    from tests.metadata_server import FakeMetadata
    from tests.training_helpers import BIN, LAUNCH_TIMEOUT, Run

    ckpt = tmp_path / "ck"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "1", "NPROC_PER_NODE": "2",
           "TRAIN_MODULE": "tests.faults", "GTS_TEST_SLOW_COMMIT_S": "35", "WORKLOAD": "tiny",
           "CHECKPOINT_EVERY": "100000", "TRAIN_STEPS": "100000"}
    trainer = subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh"), "--checkpoint-dir", str(ckpt),
                                "--throttle-ms", "20"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with FakeMetadata("aws") as meta:
        watcher = subprocess.Popen(
            [sys.executable, str(ROOT / "cloudinit/scripts/gts-spot-watch.py"), "--cloud", "aws",
             "--action", f"pid:{trainer.pid}", "--metadata-url", meta.url, "--textfile-dir", str(tmp_path / "tf"),
             "--run-dir", str(tmp_path / "run"), "--once", "--interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "GTS_LIB": str(ROOT / "training")})
        run = Run(trainer)
        run.start_reader()
        try:
            run.wait_for(r"step \d+ loss", timeout=LAUNCH_TIMEOUT)  # the workers are training
            goes = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
            meta.spot_notice = json.dumps({"action": "terminate", "time": goes})
            code = run.finish(timeout=LAUNCH_TIMEOUT)
            log, _ = watcher.communicate(timeout=LAUNCH_TIMEOUT)
        finally:
            for proc in (trainer, watcher):
                if proc.poll() is None:
                    os.killpg(proc.pid, 9) if proc is trainer else proc.kill()
    output = run.output
    assert code == 0, output[-3000:]
    took = float(re.search(r"the trainer exited ([\d.]+) s after the notice", log).group(1))  # type: ignore[union-attr]
    assert took > 30, f"the checkpoint took {took} s: the slow commit did not happen"
    committed = [p for p in ckpt.iterdir() if re.fullmatch(r"step-\d{8}", p.name)]
    assert len(committed) == 1 and (committed[0] / "manifest-node000.json").exists(), output[-2000:]
    assert "stopped by SIGTERM" in output and "emergency checkpoint" in output
    assert (tmp_path / "run" / "spot-notice").exists()


def test_the_rendezvous_store_boots_docker_and_the_store_only(sandbox: dict[str, str], tmp_path: Path) -> None:
    """The store instance's own user data (prod, AWS) laid down as its node would, then the
    bootstrap: Docker without the NVIDIA toolkit, no driver, and the store unit alone started."""
    from tests.nodes import lay_down, user_data

    root = tmp_path / "store-root"
    lay_down(user_data("aws:ec2/instance:Instance", "prod-rdzv-aws-train", ("userDataBase64",)), root)
    Path(sandbox["GTS_ENV_FILE"]).write_text((root / "etc/gpu-training/node.env").read_text())
    done = _bootstrap(sandbox)
    assert done.returncode == 0, done.stderr
    state = Path(sandbox["GTS_STATE_DIR"])
    assert (state / "runtime.done").exists() and not (state / "driver.done").exists()
    calls = _calls(sandbox)
    assert not [c for c in calls if "nvidia-container-toolkit" in c or c.startswith("nvidia-ctk")], calls
    starts = [c for c in calls if c.startswith("systemctl start")]
    assert starts == ["systemctl start --no-block gts-rdzv.service"], starts


# ------------------------------------------------------- defects the real boot found (#29)

DOCKER_STUB = Path(__file__).parent / "boot" / "docker"


def test_the_dataset_copy_runs_as_the_dataset_command_not_as_trainer_arguments(
        sandbox: dict[str, str], tmp_path: Path) -> None:
    """The docker stand-in models the trainer image: its ENTRYPOINT hands arguments to the trainer,
    which refuses `-m training.node.datasync …` (and would first join the run's rendezvous). The copy
    must replace the entrypoint."""
    box = Path(sandbox["GTS_SANDBOX"])
    shutil.copy(DOCKER_STUB, box / "bin" / "docker")
    (Path(sandbox["GTS_SBIN"]) / "gts-registry-login.py").write_text("print('login stand-in')\n")
    scratch = tmp_path / "scratch"
    Path(sandbox["GTS_ENV_FILE"]).write_text(_node_env(GTS_SCRATCH_DIR=str(scratch), GTS_TMPFS_GB="0"))
    env = {**sandbox, "GTS_DOCKER_LOG": str(box / "docker.calls"), "GTS_DOCKER_STATE": str(box / "docker"),
           "GTS_TRAINER_UID": str(os.getuid())}
    proc = subprocess.run(["bash", os.path.join(sandbox["GTS_SBIN"], "gts-dataset.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    dataset_url = cloudmeta.read_env(sandbox["GTS_ENV_FILE"])["DATASET_URL"]
    assert (scratch / "datasets/current/.gts-copied").read_text().strip() == dataset_url
    (run,) = [c for c in (box / "docker.calls").read_text().splitlines() if c.startswith("docker run")]
    assert re.search(r" --entrypoint python \S+@sha256:[0-9a-f]{64} -m training\.node\.datasync ", run), run


def test_every_unit_the_trainer_requires_starts_it_again_after_a_failed_first_try() -> None:
    """A required unit's failed start fails the trainer's start job ("Dependency failed"); its own
    automatic restart then succeeds and nothing would start the trainer: each restarting unit the
    trainer requires starts it (without waiting) once it has succeeded. The boot test runs it."""
    units = ROOT / "cloudinit/units"
    trainer = (units / "gts-trainer.service").read_text()
    required = re.search(r"^Requires=(.*)$", trainer, re.M).group(1).split()  # type: ignore[union-attr]
    restarting = [u for u in required if (units / u).exists() and "Restart=on-failure" in (units / u).read_text()]
    assert set(restarting) >= {"gts-dataset.service", "gts-shared.service"}
    for name in restarting:
        assert "ExecStartPost=-/bin/systemctl start --no-block gts-trainer.service" in (units / name).read_text(), name


def test_an_unreachable_mirror_fails_apt_update_so_the_retry_retries(sandbox: dict[str, str], tmp_path: Path) -> None:
    """The real apt-get (APT_CONFIG points it at a private state and a mirror on a closed port)
    exits 0 on `update` when nothing can be fetched unless told --error-on=any: the driver step
    must fail in its update retries, never reach the install ("Unable to locate package")."""
    real = shutil.which("apt-get")
    if real is None:
        pytest.skip("apt-get is not installed: this test runs the real one")
    apt = tmp_path / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "etc/sources.list.d", "etc/preferences.d",
                "etc/apt.conf.d", "log"):
        (apt / sub).mkdir(parents=True)
    (apt / "status").write_text("")
    (apt / "etc/sources.list").write_text("deb [trusted=yes] http://127.0.0.1:9/ubuntu jammy main\n")
    (apt / "apt.conf").write_text("\n".join([
        f'Dir::State "{apt}"; Dir::State::status "{apt}/status"; Dir::Cache "{apt}/cache";',
        f'Dir::Etc "{apt}/etc"; Dir::Log "{apt}/log"; APT::Sandbox::User "root";',
        'Acquire::Retries "0"; Debug::NoLocking "true";', ""]))
    box = Path(sandbox["GTS_SANDBOX"])
    (box / "bin" / "apt-get").unlink()  # the real one, from PATH
    env = {**sandbox, "APT_CONFIG": str(apt / "apt.conf")}
    plain = subprocess.run([real, "update", "-q"], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "Failed to fetch" in plain.stdout + plain.stderr  # what apt does
    proc = subprocess.run(["bash", os.path.join(sandbox["GTS_SBIN"], "gts-driver.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "apt-get update failed (try 6)" in proc.stderr, proc.stderr[-2000:]
    assert "Unable to locate package" not in proc.stderr
    assert not (Path(sandbox["GTS_STATE_DIR"]) / "reboot-required").exists()


def test_the_docs_name_the_signal_the_spot_watcher_sends() -> None:
    readme = (ROOT / "docs" / "node-bootstrap.md").read_text()
    section = readme[readme.index("**The emergency checkpoint gets the whole notice.**"):]
    section = section[:section.index("\n\n")]
    watcher = (ROOT / "cloudinit/scripts/gts-spot-watch.py").read_text()
    assert '["docker", "kill", "--signal", name, self.target]' in watcher
    assert "`docker kill --signal TERM gts-trainer`" in section, section
    assert "pkill" not in section and "docker exec" not in section, section


def test_the_docker_stand_in_records_each_call_whole_when_units_call_it_at_once(tmp_path: Path) -> None:
    """Units call docker at the same time at boot (the GPU gate's diag beside the bootstrap's pull
    and login). The stand-in's record is what the boot tests read: each call must be one whole
    line, never cut into by another's (it printed an argument at a time, and a real boot's gate
    line was once found broken)."""
    log = tmp_path / "calls"
    env = {**os.environ, "GTS_DOCKER_LOG": str(log), "GTS_DOCKER_STATE": str(tmp_path / "state")}
    args = " ".join("abcdefghijklmnopqrst")  # a write per argument in the old record: many chances to be cut
    at_once = f'for n in $(seq 1 100); do bash "$0" login "call $n with spaces" "a&&b" {args} & done; wait'
    subprocess.run(["bash", "-c", at_once, str(DOCKER_STUB)], env=env, stdin=subprocess.DEVNULL, check=True,
                   timeout=300)
    lines = log.read_text().splitlines()
    pattern = r"docker login call\\ \d+\\ with\\ spaces a\\&\\&b " + re.escape(args)
    whole = [line for line in lines if re.fullmatch(pattern, line)]
    assert len(lines) == 100 and len(whole) == 100, [line for line in lines if line not in whole]
