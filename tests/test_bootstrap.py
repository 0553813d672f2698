"""The node bootstrap read against systemd and the images it runs on: the rendered units verified
by `systemd-analyze` (no ordering cycle with Ubuntu's cloud-final, nothing missing), no unit
started synchronously by one it is ordered after, and the driver / runtime / scratch steps run in
a sandbox whose package managers fail the way real ones do (apt's exit 100 on a held lock) — the
node never stamps a step it did not finish, and a retry completes it."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from infra import bundle, userdata
from infra.groups import resolve
from infra.stackfile import load_stack_spec
from tests.system_tools import debian_tool
from training import cloudmeta

ROOT = bundle.ROOT


def _unpacked(root: Path) -> Path:
    """The node bundle and the user data's own files as a node has them, under `root`."""
    cloudmeta.unpack(bundle.archive(), str(root))
    shutil.copy(ROOT / "cloudinit/units/gts-fetch.service", root / "etc/systemd/system/gts-fetch.service")
    return root


def _node_env(group: str = "aws-train", stack: str = "prod", **changes: str) -> str:
    s = resolve(load_stack_spec(stack))
    text = userdata.render_env(userdata.node_context(s.spec, s.group(group), userdata.IMAGE_PLACEHOLDER))
    for k, v in changes.items():
        text = re.sub(rf"^{k}=.*$", f"{k}={v}", text, flags=re.M)
    return text


# ---------------------------------------------------------------------------- systemd

UBUNTU_CLOUD_FINAL = """[Unit]
After=network-online.target cloud-config.service rc-local.service
After=multi-user.target
Wants=network-online.target cloud-config.service
[Service]
Type=oneshot
ExecStart=/bin/true
[Install]
WantedBy=cloud-init.target
"""


def test_units_verify_with_systemd_and_form_no_ordering_cycle(tmp_path: Path) -> None:
    """systemd-analyze verify over multi-user.target with Ubuntu 22.04's cloud-final ordering
    (canonical/cloud-init systemd/cloud-final.service.tmpl: After=multi-user.target). verify exits
    0 even when it breaks a cycle by deleting a job, so its output is read."""
    tool = debian_tool("systemd-analyze", "systemd")
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = _unpacked(root) / "etc/systemd/system"
    (units / "cloud-final.service").write_text(UBUNTU_CLOUD_FINAL)
    (units / "cloud-init.target").write_text("[Unit]\nAfter=multi-user.target\n")
    for stub in ("cloud-config", "rc-local", "docker"):
        (units / f"{stub}.service").write_text("[Unit]\n[Service]\nType=oneshot\nExecStart=/bin/true\n")
    for binary in ("usr/bin/docker", "usr/bin/python3", "bin/sh", "bin/mkdir", "bin/true", "bin/systemctl"):
        path = root / binary
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    # Enable every unit as `systemctl enable` would (its WantedBy=), and cloud-final as Ubuntu does.
    wants = {"multi-user.target": ["cloud-init.target"], "cloud-init.target": ["cloud-final.service"]}
    for unit in units.glob("gts-*.service"):
        wanted_by = re.search(r"^WantedBy=(\S+)", unit.read_text(), re.M)
        assert wanted_by, f"{unit.name} is not installable"
        wants.setdefault(wanted_by.group(1), []).append(unit.name)
    for target, names in wants.items():
        (units / f"{target}.wants").mkdir(exist_ok=True)
        for name in names:
            (units / f"{target}.wants" / name).symlink_to(f"../{name}")
    proc = subprocess.run([tool, "verify", "--man=no", f"--root={root}", "multi-user.target",
                           *[u.name for u in sorted(units.glob("gts-*.service"))]],
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    for problem in ("ordering cycle", "not found", "not executable", "Failed to"):
        assert problem not in output, output
    assert proc.returncode == 0, output


def test_no_unit_is_started_synchronously_by_one_it_is_ordered_after() -> None:
    """`systemctl start X` from a unit that X is ordered after waits for itself (systemctl(1),
    --no-block): every start of a stack unit from a script or a unit does not wait."""
    sources = [ROOT / s for _, _, s in bundle.FILES] + [ROOT / "cloudinit/units/gts-fetch.service"]
    calls = 0
    for path in sources:
        for line in path.read_text().splitlines():
            # the stack's own units (docker.service is not ordered after the bootstrap)
            if re.search(r"systemctl\b.*\b(start|restart)\b.*(gts-|\"\$@\")", line) or "enable --now" in line:
                calls += 1
                assert "--no-block" in line or "start_services" in line, f"{path.name}: {line.strip()}"
    text = (ROOT / "cloudinit/scripts/gts-bootstrap.sh").read_text()
    assert 'systemctl start --no-block "$@"' in text and "enable --now" not in text
    assert calls >= 2


def test_the_trainer_starts_only_with_its_inputs_and_never_after_a_notice() -> None:
    unit = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    assert "Requires=docker.service gts-dataset.service" in unit
    assert "ConditionPathExists=/var/lib/gpu-training/ready" in unit
    assert "ConditionPathExists=!/run/gpu-training/spot-notice" in unit
    watcher = (ROOT / "cloudinit/scripts/gts-spot-watch.py").read_text()
    assert '"spot-notice"' in watcher and '"/run/gpu-training"' in watcher
    assert "TimeoutStartSec=infinity" in (ROOT / "cloudinit/units/gts-dataset.service").read_text()
    ordering = [line for line in (ROOT / "cloudinit/units/gts-bootstrap.service").read_text().splitlines()
                if line.startswith(("After=", "Before="))]
    assert ordering == ["After=network-online.target"]  # the systemd check above proves no cycle


# ------------------------------------------------------------------------- sandbox

STUB = """#!/bin/bash
# {name}: a stand-in that behaves as the real one does in the cases under test.
echo "{name} $*" >> "$GTS_SANDBOX/calls"
{body}
"""
APT = """
if [ -e "$GTS_SANDBOX/apt-locked" ]; then
  n=$(cat "$GTS_SANDBOX/apt-locked"); echo $((n - 1)) > "$GTS_SANDBOX/apt-locked"
  [ "$n" -le 1 ] && rm -f "$GTS_SANDBOX/apt-locked"
  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1234 (unattended-upgr)" >&2
  exit 100
fi
case " $* " in *" install "*) ;; *) exit 0 ;; esac
case " $* " in *" -y "*) ;; *) echo "Do you want to continue? [Y/n] Abort." >&2; exit 1 ;; esac
for pkg in "$@"; do
  case "$pkg" in
    nvidia-driver-*) touch "$GTS_SANDBOX/driver-installed" ;;
    docker.io) printf '#!/bin/bash\\necho "docker $*" >> "$GTS_SANDBOX/calls"\\n' > "$GTS_SANDBOX/bin/docker"; chmod +x "$GTS_SANDBOX/bin/docker" ;;
    nvidia-container-toolkit) printf '#!/bin/bash\\necho "nvidia-ctk $*" >> "$GTS_SANDBOX/calls"\\n' > "$GTS_SANDBOX/bin/nvidia-ctk"; chmod +x "$GTS_SANDBOX/bin/nvidia-ctk" ;;
  esac
done
"""
GPG = """
out=""; yes=""; batch=""
while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift ;; --yes) yes=1 ;; --batch) batch=1 ;; esac; shift; done
cat > /dev/null
if [ -e "$out" ] && { [ -z "$yes" ] || [ -z "$batch" ]; }; then
  echo "gpg: cannot open '/dev/tty': No such device or address" >&2; exit 2
fi
echo key > "$out"
"""
STUBS = {
    "apt-get": APT,
    "gpg": GPG,
    "nvidia-smi": '[ -e "$GTS_SANDBOX/driver-working" ] || exit 9',
    "dpkg-query": 'echo "535.216.03-0ubuntu0.22.04.1"',
    "uname": 'echo "6.8.0-1015-aws"',
    "curl": 'echo "-----BEGIN PGP PUBLIC KEY BLOCK-----"',
    "systemctl": "exit 0",
    "logger": "exit 0",
    "sleep": "exit 0",
}


@pytest.fixture()
def sandbox(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(STUB.format(name=name, body=body))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    for _, _, source in bundle.FILES:
        if "/scripts/" in source:
            shutil.copy(ROOT / source, sbin / Path(source).name)
    (tmp_path / "os-release").write_text('ID=ubuntu\nVERSION_ID="22.04"\n')
    # The driver / runtime path of a p4d node; its EFA step (gts-fabric.sh install, which fetches
    # the EFA installer) runs for real against a fake sysfs in tests/test_fabric.py.
    (tmp_path / "node.env").write_text(_node_env(GTS_NVSWITCH="true", GTS_FABRIC=""))
    (tmp_path / "etc/apt/sources.list.d").mkdir(parents=True)
    (tmp_path / "etc/apt/sources.list").write_text("deb http://archive.ubuntu.com/ubuntu jammy main\n")
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "GTS_SANDBOX": str(tmp_path), "GTS_ENV_FILE": str(tmp_path / "node.env"),
            "GTS_STATE_DIR": str(tmp_path / "state"), "GTS_SBIN": str(sbin), "GTS_OS_RELEASE": str(tmp_path / "os-release"),
            "GTS_ETC": str(tmp_path / "etc"), "HOME": str(tmp_path)}


def _bootstrap(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", os.path.join(env["GTS_SBIN"], "gts-bootstrap.sh")], env=env,
                          capture_output=True, text=True, timeout=120)


def _calls(env: dict[str, str]) -> list[str]:
    path = Path(env["GTS_SANDBOX"]) / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_a_locked_apt_is_a_failure_never_a_stamp_and_a_retry_finishes(sandbox: dict[str, str]) -> None:
    box, state = Path(sandbox["GTS_SANDBOX"]), Path(sandbox["GTS_STATE_DIR"])
    (box / "apt-locked").write_text("6")  # as long as the update retries: the step fails
    first = _bootstrap(sandbox)
    assert first.returncode != 0, first.stdout
    assert not (state / "driver.done").exists() and not (state / "reboot-required").exists()
    assert "systemctl reboot" not in _calls(sandbox)
    # The unit restarts the bootstrap; the lock is free now.
    second = _bootstrap(sandbox)
    assert second.returncode == 0, second.stderr
    assert (state / "driver.done").exists() and "systemctl reboot" in _calls(sandbox)
    installs = [c for c in _calls(sandbox) if c.startswith("apt-get") and " install " in c]
    assert all("DPkg::Lock::Timeout=600" in c for c in installs)
    # Fabric Manager pinned to the driver's exact version.
    assert any("nvidia-fabricmanager-535=535.216.03-0ubuntu0.22.04.1" in c for c in installs)
    # After the reboot: the driver works, the runtime step runs, the services start without waiting.
    (box / "driver-working").touch()
    third = _bootstrap(sandbox)
    assert third.returncode == 0, third.stderr
    assert (state / "runtime.done").exists() and (state / "ready").exists()
    starts = [c for c in _calls(sandbox) if c.startswith("systemctl start")]
    assert starts and all("--no-block" in c for c in starts)
    assert "gts-trainer.service" in starts[-1] and "gts-dataset.service" in starts[-1]


def test_a_retried_toolkit_step_overwrites_its_key(sandbox: dict[str, str]) -> None:
    """gpg --dearmor -o on an existing file without --batch --yes exits 2 without a tty."""
    script = os.path.join(sandbox["GTS_SBIN"], "gts-runtime.sh")
    first = subprocess.run(["bash", script], env=sandbox, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    os.remove(os.path.join(sandbox["GTS_SANDBOX"], "bin", "nvidia-ctk"))  # as if the install had failed
    again = subprocess.run(["bash", script], env=sandbox, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    daemon = Path(sandbox["GTS_ETC"]) / "docker/daemon.json"
    assert "registry-mirrors" not in daemon.read_text()  # AWS: no Docker Hub mirror


def test_china_nodes_take_packages_and_hub_images_from_their_cloud(sandbox: dict[str, str]) -> None:
    Path(sandbox["GTS_ENV_FILE"]).write_text(_node_env("tc-train"))
    script = os.path.join(sandbox["GTS_SBIN"], "gts-runtime.sh")
    proc = subprocess.run(["bash", script], env=sandbox, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    etc = Path(sandbox["GTS_ETC"])
    assert '"registry-mirrors": ["https://mirror.ccs.tencentyun.com"]' in (etc / "docker/daemon.json").read_text()
    assert "mirrors.tencentyun.com/libnvidia-container" in (etc / "apt/sources.list.d/nvidia-container-toolkit.list").read_text()
    assert "mirrors.tencentyun.com/ubuntu" in (etc / "apt/sources.list").read_text()
    assert not any("nvidia.github.io" in c for c in _calls(sandbox))


def test_scratch_never_hides_a_failing_disk_picker(sandbox: dict[str, str], tmp_path: Path) -> None:
    script = os.path.join(sandbox["GTS_SBIN"], "gts-nvme.sh")
    picker = tmp_path / "picker"
    Path(sandbox["GTS_ENV_FILE"]).write_text(_node_env(GTS_SCRATCH_DIR=str(tmp_path / "scratch")))
    env = {**sandbox, "GTS_DISK_PICKER": str(picker), "GTS_DLAMI_NVME": str(tmp_path / "no-dlami"),
           "GTS_FSTAB": str(tmp_path / "fstab"), "GTS_TRAINER_UID": str(os.getuid())}
    for name, body in (("mountpoint", "exit 1"), ("blkid", "exit 2")):
        path = Path(sandbox["GTS_SANDBOX"]) / "bin" / name
        path.write_text(STUB.format(name=name, body=body))
        path.chmod(0o755)
    picker.write_text("#!/bin/sh\necho 'lsblk: unknown option --json' >&2\nexit 1\n")
    picker.chmod(0o755)
    failing = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert failing.returncode != 0 and "no free NVMe" not in failing.stdout
    picker.write_text("#!/bin/sh\nexit 0\n")
    empty = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert empty.returncode == 0 and "no free NVMe or data disk" in empty.stdout
    # The non-root training container writes its checkpoints and dataset cache there.
    for folder in ("checkpoints", "datasets"):
        assert (tmp_path / "scratch" / folder).stat().st_uid == os.getuid()
    assert (tmp_path / "scratch").stat().st_mode & 0o7777 == 0o1777
    # The DLAMI assembled the instance store already: bind-mount it, never build on the root disk.
    mountpoint = Path(sandbox["GTS_SANDBOX"]) / "bin" / "mountpoint"
    mountpoint.write_text(STUB.format(name="mountpoint", body=f'[ "$2" = "{tmp_path}/no-dlami" ]'))
    mount = Path(sandbox["GTS_SANDBOX"]) / "bin" / "mount"
    mount.write_text(STUB.format(name="mount", body="exit 0"))
    mount.chmod(0o755)
    dlami = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert dlami.returncode == 0 and f"mount --bind {tmp_path}/no-dlami {tmp_path}/scratch" in _calls(sandbox)


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
