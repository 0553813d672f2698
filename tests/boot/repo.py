"""A local, signed apt archive for a booted node: stand-in packages built with dpkg-deb, indexed
by dpkg-scanpackages, its Release signed (InRelease) with a test archive key the node trusts, and
served over HTTP in the node's network namespace under the archive's own host name (the node's
/etc/hosts), so the node's real apt-get update / install run unchanged against it.

The packages stand in for what the node's scripts install from the archive: `nfs-common` and
`amazon-efs-utils` (their mount.nfs / mount.efs "mount" an export the test serves by binding it,
once the test has exported it), and the bare image's driver path (driver_packages, DOCKER_IO,
NVIDIA_CONTAINER_TOOLKIT from NVIDIA's flat repository)."""

from __future__ import annotations

import fcntl
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

SUITE = "bookworm"  # the base root's sources.list: deb http://deb.debian.org/debian bookworm main (root = .../debian)
ARCHIVE_HOST = "deb.debian.org"
NFS_EXPORT = "/srv/gts-nfs"  # the test's NFS "server" (a host folder bound into the node)


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    files: dict[str, str] = field(default_factory=dict)  # path -> text (executable under bin/ or with a #!)
    description: str = "boot-test stand-in"
    postinst: str = ""  # DEBIAN/postinst, run by dpkg on the node


NFS_COMMON = Package("nfs-common", "1:2.6.2-4+gts", {
    "usr/sbin/mount.nfs": textwrap.dedent(f"""\
        #!/bin/sh
        # mount.nfs stand-in (the boot test's nfs-common): SOURCE DIR -o OPTIONS -> the test's export,
        # bound at DIR once the test has exported it ({NFS_EXPORT}/exported); refused before that.
        echo "mount.nfs $*" >> /var/log/gts-mount-nfs.calls
        if [ ! -e {NFS_EXPORT}/exported ]; then
          echo "mount.nfs: Connection refused (the export is not there yet)" >&2
          exit 32
        fi
        exec mount --bind {NFS_EXPORT}/data "$2"
        """),
}, "NFS client (stand-in): mount.nfs / mount.nfs4")
NFS_COMMON.files["usr/sbin/mount.nfs4"] = NFS_COMMON.files["usr/sbin/mount.nfs"]
# AWS's EFS mount helper (github.com/aws/efs-utils), the same stand-in under its name: `mount -t efs`.
AMAZON_EFS_UTILS = Package("amazon-efs-utils", "2.1.0-1+gts", {
    "usr/sbin/mount.efs": NFS_COMMON.files["usr/sbin/mount.nfs"].replace("mount.nfs", "mount.efs")
                                                                 .replace("mount-nfs", "mount-efs"),
}, "EFS mount helper (stand-in): mount.efs")


def archive_key(cache: Path) -> Path:
    """The test archive's signing key (a gpg home under the cache), made once."""
    home = cache / "archive-gpg"
    with open(cache / "archive-gpg.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "public.gpg").exists():
            home.mkdir(mode=0o700, exist_ok=True)
            subprocess.run(["gpg", "--batch", "--homedir", str(home), "--passphrase", "", "--quick-gen-key",
                            "gts boot test archive", "rsa2048", "sign", "never"], check=True, capture_output=True,
                           timeout=300)
            public = subprocess.run(["gpg", "--batch", "--homedir", str(home), "--export"], check=True,
                                    capture_output=True, timeout=60).stdout
            (home / "public.gpg").write_bytes(public)
    return home


def dpkg_arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True, text=True).stdout.strip()


def build(root: Path, packages: list[Package], cache: Path, flat: bool = False) -> bytes:
    """Build the archive under `root` (dists/, pool/); returns the public key the node must trust.
    `flat`: a flat repository (`deb [signed-by=…] URL /`, NVIDIA's libnvidia-container layout):
    Packages, Release and InRelease next to the packages, no dists/."""
    pool = root if flat else root / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    arch = dpkg_arch()
    for package in packages:
        tree = root.parent / f"pkg-{root.name}-{package.name}"
        (tree / "DEBIAN").mkdir(parents=True, exist_ok=True)
        (tree / "DEBIAN/control").write_text(
            f"Package: {package.name}\nVersion: {package.version}\nArchitecture: {arch}\n"
            f"Maintainer: gts boot test <boot@invalid>\nDescription: {package.description}\n")
        for path, text in package.files.items():
            target = tree / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            target.chmod(0o755 if "bin/" in path or text.startswith("#!") else 0o644)
        if package.postinst:
            (tree / "DEBIAN/postinst").write_text(package.postinst)
            (tree / "DEBIAN/postinst").chmod(0o755)
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree),
                        str(pool / f"{package.name}.deb")], check=True, capture_output=True, timeout=120)
    binary = root if flat else root / f"dists/{SUITE}/main/binary-{arch}"
    binary.mkdir(parents=True, exist_ok=True)
    index = subprocess.run(["dpkg-scanpackages", "--multiversion", "." if flat else "pool", "/dev/null"], cwd=root,
                           check=True, capture_output=True, timeout=120).stdout
    (binary / "Packages").write_bytes(index)
    import hashlib
    from email.utils import formatdate

    name = "Packages" if flat else f"main/binary-{arch}/Packages"
    entry = f" {hashlib.sha256(index).hexdigest()} {len(index)} {name}\n"
    release = root / "Release" if flat else root / f"dists/{SUITE}/Release"
    # Origin / Label as the archive it stands in for (apt refuses a repository whose Origin changed).
    head = "Origin: NVIDIA\nLabel: NVIDIA CUDA\n" if flat else \
        f"Origin: Debian\nLabel: Debian\nSuite: {SUITE}\nCodename: {SUITE}\nComponents: main\n"
    release.write_text(f"{head}Date: {formatdate(usegmt=True)}\nArchitectures: {arch}\nSHA256:\n{entry}")
    home = archive_key(cache)
    subprocess.run(["gpg", "--batch", "--yes", "--homedir", str(home), "--clearsign", "-o",
                    str(release.parent / "InRelease"), str(release)], check=True, capture_output=True, timeout=120)
    return (home / "public.gpg").read_bytes()


def armored_key(cache: Path) -> bytes:
    """The archive key ASCII-armored, as a repository publishes it (NVIDIA's `gpgkey`)."""
    home = archive_key(cache)
    return subprocess.run(["gpg", "--batch", "--homedir", str(home), "--export", "--armor"], check=True,
                          capture_output=True, timeout=60).stdout


# The bare image's driver path (gts-driver.sh, gts-runtime.sh): what apt installs there.
HERE = Path(__file__).parent
UNIT = "[Unit]\nDescription={0} (stand-in)\n[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/true\n" \
       "[Install]\nWantedBy=multi-user.target\n"


def driver_packages(kernel: str, branch: str) -> list[Package]:
    """The Ubuntu archive's driver packages (gts-driver.sh). The driver's kernel module loads on
    the next boot only: its postinst records this boot's id, and nvidia-smi (tests/boot/gpu) fails
    as the real one does without a loaded module ("couldn't communicate", exit 9) until the node
    has rebooted (systemd-nspawn gives each boot of the container a new boot id)."""
    return [
        Package(f"linux-headers-{kernel}", "1.0+gts", description="kernel headers (stand-in)"),
        Package(f"nvidia-driver-{branch}-server", "535.183.01-0ubuntu1+gts", postinst=textwrap.dedent("""\
            #!/bin/sh
            mkdir -p /var/lib/gts-gpu-stub
            cat /proc/sys/kernel/random/boot_id > /var/lib/gts-gpu-stub/module-on-next-boot
            """), description="NVIDIA driver (stand-in): the module loads after a reboot"),
        Package(f"nvidia-utils-{branch}-server", "535.183.01-0ubuntu1+gts",
                {"usr/bin/nvidia-smi": (HERE / "gpu/nvidia-smi").read_text()}, "NVIDIA utilities (stand-in)"),
    ]


DOCKER_IO = Package("docker.io", "24.0.7-0ubuntu2+gts", {
    "usr/bin/docker": (HERE / "docker").read_text(),
    "lib/systemd/system/docker.service": UNIT.format("Docker"),
    # docker's model of the DCGM exporter image (the GPU gate's dcgmi runs in it)
    "usr/lib/gts-docker-stub/images/dcgm-exporter/dcgmi": (HERE / "gpu/dcgmi").read_text(),
    "usr/lib/gts-docker-stub/images/dcgm-exporter/nv-hostengine": (HERE / "gpu/nv-hostengine").read_text(),
}, "Docker (stand-in, recording: tests/boot/docker)")

NVIDIA_CONTAINER_TOOLKIT = Package("nvidia-container-toolkit", "1.16.2-1+gts", {
    "usr/bin/nvidia-ctk": "#!/bin/sh\necho \"nvidia-ctk $*\" >> /var/log/gts-nvidia-ctk.calls\n",
}, "NVIDIA container toolkit (stand-in), from NVIDIA's flat repository")
