"""The node bootstrap read against systemd and the images it runs on: the rendered units verified
by `systemd-analyze` (no ordering cycle with Ubuntu's cloud-final, nothing missing), no unit
started synchronously by one it is ordered after, and the driver / runtime / scratch steps run in
a sandbox whose package managers fail the way real ones do (apt's exit 100 on a held lock) — the
node never stamps a step it did not finish, and a retry completes it. The spot path end to end,
the rendezvous store and the defects the real boot found are in tests/test_bootstrap_paths.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.render import bundle
from tests.bootstrap_helpers import ROOT, STUB, _bootstrap, _calls, _node_env, make_sandbox
from tests.system_tools import debian_tool
from training import cloudmeta


def _unpacked(root: Path) -> Path:
    """The node bundle and the user data's own files as a node has them, under `root`."""
    cloudmeta.unpack(bundle.archive(), str(root))
    shutil.copy(ROOT / "cloudinit/units/gts-fetch.service", root / "etc/systemd/system/gts-fetch.service")
    return root


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

@pytest.fixture()
def sandbox(tmp_path: Path) -> dict[str, str]:
    """The node's scripts and their stand-ins (tests/bootstrap_helpers.py), one per test."""
    return make_sandbox(tmp_path)


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
