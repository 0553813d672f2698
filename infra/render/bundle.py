"""The node bundle: every script and systemd unit a GPU node runs, as one reproducible gzip tar
that the stack stores in its bucket (`nodes/bundle-<sha>.tar.gz.b64`). The user data carries
only the node's settings, the small fetcher (training/cloudmeta.py, with its cloud's
metadata.py) and the bundle's sha256, so
it stays far below every cloud's user-data limit however the scripts grow, and a node never
runs scripts other than the ones the plan pinned."""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from infra.buckets import NODES_PREFIX
from infra.clouds import NAMES

ROOT = Path(__file__).resolve().parents[2]
CLOUDINIT = ROOT / "cloudinit"

# Each cloud's node-side files under infra/clouds/<cloud>/ (docs/adding-a-cloud.md section 5).
NODE_PARTS = ("node.py", "fabric.sh", "shared.sh")
# (path on the node, mode, source under the repository)
FILES = (
    ("/usr/local/sbin/gts-bootstrap.sh", 0o755, "cloudinit/scripts/gts-bootstrap.sh"),
    ("/usr/local/sbin/gts-lib.sh", 0o644, "cloudinit/scripts/gts-lib.sh"),  # sourced by the scripts beside it
    ("/usr/local/sbin/gts-driver.sh", 0o755, "cloudinit/scripts/gts-driver.sh"),
    ("/usr/local/sbin/gts-fabric.sh", 0o755, "cloudinit/scripts/gts-fabric.sh"),
    ("/usr/local/sbin/gts-node-addr.sh", 0o755, "cloudinit/scripts/gts-node-addr.sh"),
    ("/usr/local/sbin/gts-runtime.sh", 0o755, "cloudinit/scripts/gts-runtime.sh"),
    ("/usr/local/sbin/gts-nvme.sh", 0o755, "cloudinit/scripts/gts-nvme.sh"),
    ("/usr/local/sbin/gts-disks.py", 0o755, "cloudinit/scripts/gts-disks.py"),
    ("/usr/local/sbin/gts-dataset.sh", 0o755, "cloudinit/scripts/gts-dataset.sh"),
    ("/usr/local/sbin/gts-shared.sh", 0o755, "cloudinit/scripts/gts-shared.sh"),
    ("/usr/local/sbin/gts-spot-watch.py", 0o755, "cloudinit/scripts/gts-spot-watch.py"),
    ("/usr/local/sbin/gts-registry-login.py", 0o755, "cloudinit/scripts/gts-registry-login.py"),
    ("/usr/local/sbin/gts-rdzv-key.py", 0o755, "cloudinit/scripts/gts-rdzv-key.py"),
    ("/usr/local/sbin/gts-image.py", 0o755, "cloudinit/scripts/gts-image.py"),
    ("/usr/local/sbin/gts-gpu-health.py", 0o755, "cloudinit/scripts/gts-gpu-health.py"),
    ("/usr/local/sbin/gts-gpu-gate-checks.py", 0o755, "cloudinit/scripts/gts-gpu-gate-checks.py"),
    ("/usr/local/lib/gts/node_replace.py", 0o644, "training/node/node_replace.py"),
    ("/usr/local/lib/gts/replace_budget.py", 0o644, "training/node/replace_budget.py"),
    ("/usr/local/lib/gts/gpu_health.yaml", 0o644, "infra/data/gpu_health.yaml"),
    ("/etc/gpu-training/dcgm-counters.csv", 0o644, "cloudinit/dcgm-counters.csv"),
    ("/etc/systemd/system/gts-bootstrap.service", 0o644, "cloudinit/units/gts-bootstrap.service"),
    ("/etc/systemd/system/gts-scratch.service", 0o644, "cloudinit/units/gts-scratch.service"),
    ("/etc/systemd/system/gts-dataset.service", 0o644, "cloudinit/units/gts-dataset.service"),
    ("/etc/systemd/system/gts-shared.service", 0o644, "cloudinit/units/gts-shared.service"),
    ("/etc/systemd/system/gts-trainer.service", 0o644, "cloudinit/units/gts-trainer.service"),
    ("/etc/systemd/system/gts-spot-watch.service", 0o644, "cloudinit/units/gts-spot-watch.service"),
    ("/etc/systemd/system/gts-exporters.service", 0o644, "cloudinit/units/gts-exporters.service"),
    ("/etc/systemd/system/gts-rdzv.service", 0o644, "cloudinit/units/gts-rdzv.service"),
    ("/etc/systemd/system/gts-gpu-gate.service", 0o644, "cloudinit/units/gts-gpu-gate.service"),
    ("/etc/systemd/system/gts-gpu-watch.service", 0o644, "cloudinit/units/gts-gpu-watch.service"),
    # Every cloud's node module (the scripts' cloud calls; training/cloudmeta.py cloud_node) and
    # shell fragments (what gts-fabric.sh and gts-shared.sh do per cloud; gts-lib.sh cloud_fragment):
    # one bundle serves every cloud's nodes. Each node's metadata module comes in its user data.
    *((f"/usr/local/lib/gts/clouds/{cloud}/{part}", 0o644, f"infra/clouds/{cloud}/{part}")
      for cloud in NAMES for part in NODE_PARTS),
)


@dataclass(frozen=True)
class Bundle:
    content: str  # base64 of the gzip tar: the object's text content
    sha256: str  # of `content`, as the node downloads it

    @property
    def key(self) -> str:
        return f"{NODES_PREFIX}bundle-{self.sha256[:16]}.tar.gz.b64"


def archive(files: tuple[tuple[str, int, str], ...] = FILES, root: Path = ROOT) -> bytes:
    """The files as a gzip tar with fixed owners and times: the same sources give the same bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, mode, source in files:
            data = (root / source).read_bytes()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


@functools.cache
def build() -> Bundle:
    content = base64.b64encode(archive()).decode()
    return Bundle(content, hashlib.sha256(content.encode()).hexdigest())
