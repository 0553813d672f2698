"""The root a boot-test node boots from (tests/boot/node.py): the base root (Debian bookworm from
debootstrap: systemd, cloud-init, python3) is built once and cached outside the repository, keyed
by its package list, under a lock (parallel workers and later sessions reuse it); what a node's
image adds to it — the Deep Learning AMI's driver, Docker and toolkit stand-ins, a managed
Kubernetes image's crictl, bare Ubuntu's apt sources — is a per-node layer (image_layer), and
EFA devices are stand-in sysfs entries (efa_devices). Skips loudly where the host cannot build it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.boot import repo

HERE = Path(__file__).parent
SUITE, MIRROR = "bookworm", os.environ.get("GTS_BOOT_MIRROR", "http://deb.debian.org/debian")
# python3-cffi-backend by name: debootstrap does not resolve the virtual package cryptography needs
# (cloud-init would stay unconfigured); locales: cloud-init's locale module needs locale-gen, as on Ubuntu.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "cloud-init", "python3", "python3-cffi-backend", "ca-certificates",
            "curl", "iproute2", "util-linux", "procps", "apt", "openssl", "locales", "gpg")
# The base root holds what every image has; what an image adds (the DLAMI's driver, Docker and
# toolkit) is a per-node layer (image_layer), so a bare image boots from the same base.
BASE_FILES = {"etc/cloud/cloud.cfg.d/90-gts-boot.cfg": "datasource_list: [NoCloud, None]\n"}


def skip_or_fail(reason: str) -> None:
    """Skip loudly where the host cannot boot a node; CI must never skip."""
    if os.environ.get("CI"):
        pytest.fail(reason + " — CI must run the boot test")
    pytest.skip("BOOT TEST NOT RUN: " + reason)


def check_host() -> None:
    if os.geteuid() != 0:
        skip_or_fail("needs root (debootstrap, mounts, network namespaces)")
    for tool, package in (("debootstrap", "debootstrap"), ("systemd-nspawn", "systemd-container"),
                          ("ip", "iproute2"), ("unshare", "util-linux"), ("openssl", "openssl")):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} is missing: `make tools` installs Debian's {package} (apt-get install {package})")


def cache_dir() -> Path:
    base = os.environ.get("GTS_BOOT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gts-boot")
    key = hashlib.sha256(json.dumps([SUITE, MIRROR, PACKAGES, BASE_FILES]).encode()).hexdigest()[:16]
    return Path(base) / key


def base_image() -> Path:
    """The cached base root (built under a lock: parallel workers wait for one build)."""
    check_host()
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / "root"
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cache / "ready").exists():
            return root
        shutil.rmtree(cache / "building", ignore_errors=True)
        proc = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                               str(cache / "building"), MIRROR], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            skip_or_fail(f"debootstrap {SUITE} from {MIRROR} failed: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        building = cache / "building"
        audit = subprocess.run(["chroot", str(building), "dpkg", "--audit"], capture_output=True, text=True, timeout=120)
        if audit.stdout.strip():
            skip_or_fail(f"debootstrap left packages unconfigured: {audit.stdout[-1500:]}")
        for path, text in BASE_FILES.items():
            target = building / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        # The store's certificate authority, trusted by the node (the clouds' endpoints are public CAs).
        ca = cache / "ca"
        ca.mkdir(exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                        "-subj", "/CN=gts boot test CA", "-keyout", str(ca / "ca.key"), "-out", str(ca / "ca.crt")],
                       check=True, capture_output=True, timeout=120)
        shutil.copy(ca / "ca.crt", building / "usr/local/share/ca-certificates/gts-boot-ca.crt")
        subprocess.run(["chroot", str(building), "update-ca-certificates"], check=True, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
        building.rename(root)
        (cache / "ready").touch()
    return root


def image_layer(upper: Path, image: str) -> None:
    """What the node's image adds to the base root, laid into the node's overlay ("bare",
    "kubernetes" or "dlami"). "dlami": the Deep
    Learning AMI's driver (nvidia-smi), Docker (tests/boot/docker, recording; an enabled
    docker.service) and toolkit (nvidia-ctk), the DCGM exporter image's dcgmi for docker's model."""
    if image == "bare":
        # Bare Ubuntu: no driver, Docker or toolkit; apt's sources name Ubuntu's archive, which the
        # node reaches only through the mirror the plan names (gts-runtime.sh rewrites them).
        (upper / "etc/apt").mkdir(parents=True, exist_ok=True)
        (upper / "etc/apt/sources.list").write_text(f"deb http://archive.ubuntu.com/ubuntu {repo.SUITE} main\n")
        return
    if image == "kubernetes":
        # A managed-Kubernetes GPU image (EKS AL2023 NVIDIA, ACK, TKE Ubuntu): its containerd and
        # kubelet run the trainer Job; the node's scripts reach its container through crictl
        # (tests/boot/crictl, recording), which "runs" the Job's trainer container here.
        (upper / "usr/bin").mkdir(parents=True, exist_ok=True)
        shutil.copy(HERE / "crictl", upper / "usr/bin/crictl")
        (upper / "var/lib/gts-crictl-stub").mkdir(parents=True, exist_ok=True)
        (upper / "var/lib/gts-crictl-stub/trainer").write_text("0123456789ab\n")
        return
    if image != "dlami":
        raise ValueError(f"no layer for image {image!r}")
    files = {"usr/bin/docker": HERE / "docker", "usr/bin/nvidia-smi": HERE / "gpu/nvidia-smi",
             "usr/lib/gts-docker-stub/images/dcgm-exporter/dcgmi": HERE / "gpu/dcgmi",
             "usr/lib/gts-docker-stub/images/dcgm-exporter/nv-hostengine": HERE / "gpu/nv-hostengine"}
    for path, source in files.items():
        (upper / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, upper / path)
    texts = {"usr/bin/nvidia-ctk": "#!/bin/sh\necho \"nvidia-ctk $*\" >> /var/log/gts-nvidia-ctk.calls\n",
             "etc/systemd/system/docker.service": "[Unit]\nDescription=Docker (stand-in)\n[Service]\nType=oneshot\n"
                                                  "RemainAfterExit=yes\nExecStart=/bin/true\n[Install]\n"
                                                  "WantedBy=multi-user.target\n",
             # The DLAMI's EFA user space (the EFA installer's libfabric) and GDRCopy's loaded module,
             # as `gts-fabric.sh install` asks for them (lsmod stands for the kernel's module list).
             "opt/amazon/efa/bin/fi_info": "#!/bin/sh\necho 'provider: efa'\necho '    fabric: efa'\n",
             "usr/sbin/lsmod": "#!/bin/sh\necho 'Module                  Size  Used by'\necho 'gdrdrv                 24576  0'\n"
                               "echo 'efa                   147456  0'\n",
             # The DLAMI's Fabric Manager (what the gate asks on NVSwitch types), running.
             "etc/systemd/system/nvidia-fabricmanager.service": "[Unit]\nDescription=NVIDIA Fabric Manager (stand-in)\n"
                                                                "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
                                                                "ExecStart=/bin/true\n[Install]\n"
                                                                "WantedBy=multi-user.target\n"}
    for path, text in texts.items():
        (upper / path).parent.mkdir(parents=True, exist_ok=True)
        (upper / path).write_text(text)
        (upper / path).chmod(0o755 if "bin/" in path else 0o644)
    wants = upper / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in ("docker.service", "nvidia-fabricmanager.service"):
        (wants / unit).symlink_to(f"/etc/systemd/system/{unit}")


EFA_SYSFS = "/srv/gts-efa-sys"  # the node's stand-in sysfs for its EFA devices (GTS_SYSFS of gts-fabric.sh)


def efa_devices(workdir: Path, count: int) -> tuple[str, ...]:
    """nspawn arguments giving the node `count` EFA verbs devices as sysfs shows them
    (class/infiniband/rdmapNs0/device/driver -> .../efa) at EFA_SYSFS — the container's /sys is
    the host's, read-only, with no /sys/class/infiniband to bind over — and a /dev/infiniband."""
    sysfs = workdir / "sysfs"
    for i in range(count):
        device = sysfs / f"class/infiniband/rdmap{16 + i}s0/device"
        device.mkdir(parents=True, exist_ok=True)
        if not (device / "driver").is_symlink():
            (device / "driver").symlink_to("../../../../bus/pci/drivers/efa")
    (workdir / "dev-infiniband").mkdir(exist_ok=True)
    return (f"--bind-ro={sysfs}:{EFA_SYSFS}", f"--bind={workdir / 'dev-infiniband'}:/dev/infiniband")
