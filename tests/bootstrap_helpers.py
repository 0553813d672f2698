"""What the node-bootstrap tests share (tests/test_bootstrap*.py): a prod node's node.env, and a
sandbox where the node's scripts run against stand-ins for the tools they call (apt-get, gpg,
nvidia-smi, systemctl, …) that record their calls and fail the way the real ones do."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

from infra import userdata
from infra.render import bundle
from infra.resolve.groups import resolve
from infra.stack.stackfile import load_stack_spec


ROOT = bundle.ROOT


def _node_env(group: str = "aws-train", stack: str = "prod", **changes: str) -> str:
    s = resolve(load_stack_spec(stack))
    text = userdata.render_env(userdata.node_context(s.spec, s.group(group), userdata.IMAGE_PLACEHOLDER))
    for k, v in changes.items():
        text = re.sub(rf"^{k}=.*$", f"{k}={v}", text, flags=re.M)
    return text


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


def make_sandbox(tmp_path: Path) -> dict[str, str]:
    """The node's scripts under tmp_path/sbin, the stand-ins (STUBS) first on PATH, a p4d node's
    node.env, Ubuntu 22.04's os-release and apt sources: the environment the scripts run in."""
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
    # the EFA installer) runs for real against a fake sysfs in tests/test_fabric_node.py.
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
