"""Multi-node fabrics (#30) on the node: the trainer env each fabric's group renders (NCCL
settings), and cloudinit/scripts/gts-fabric.sh run for real (check, install, nccl-test) against
a laid-out sysfs and a stand-in docker / installer; an HCC group's fixed instances are
quarantined, not handed back, on a GPU fault."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra import clouds, userdata
from infra.resolve.groups import resolve
from tests.fabric_helpers import fabric_values, node_lib
from tests.harness import parse_spec
from tests.harness import ROOT, spec_raw

SCRIPT = ROOT / "cloudinit" / "scripts" / "gts-fabric.sh"
CLOUD_OF_FABRIC = {p.fabric: p.name for p in clouds.profiles()}


# ---------------------------------------------------------------------------- the node

@pytest.fixture(scope="module")
def fabric_stack() -> Any:
    return resolve(parse_spec(spec_raw(fabric_values())))


def test_trainer_env_carries_each_fabrics_nccl_settings(fabric_stack: Any) -> None:
    efa = fabric_stack.group("aws-efa").trainer
    assert (efa["FI_PROVIDER"], efa["FI_EFA_USE_DEVICE_RDMA"], efa["GTS_FABRIC_DEVICES"]) == ("efa", "1", "32")
    erdma = fabric_stack.group("ali-erdma").trainer
    assert erdma["NCCL_IB_HCA"] == "erdma" and erdma["NCCL_IB_GID_INDEX"] == "-1"
    assert erdma["NCCL_IB_ADDR_RANGE"] == "10.40.0.0/16" and erdma["NCCL_NET_GDR_LEVEL"] == "SYS"
    hcc = fabric_stack.group("tc-hcc").trainer
    assert hcc["NCCL_IB_GID_INDEX"] == "3" and hcc["NCCL_IB_HCA"] == "mlx5_bond"
    ctx = userdata.node_context(fabric_stack.spec, fabric_stack.group("aws-efa"), userdata.IMAGE_PLACEHOLDER)
    env = userdata.render_env(ctx)
    assert "FI_PROVIDER=efa" in env and "GTS_FABRIC=efa" in env and "NCCL_SOCKET_IFNAME=en\n" in env
    assert "^lo,docker" not in env, "one NCCL_SOCKET_IFNAME: the fabric's"
    plain = userdata.render_env(userdata.node_context(fabric_stack.spec, fabric_stack.group("ali-train"),
                                                      userdata.IMAGE_PLACEHOLDER))
    assert "NCCL_SOCKET_IFNAME=^lo,docker" in plain and "GTS_FABRIC" not in plain


def lay_out(root: Path, fabric_name: str, names: list[str]) -> Path:
    sysfs = root / "sys"
    for name in names:
        dev = sysfs / "class" / "infiniband" / name / "device"
        if dev.exists():
            continue
        dev.mkdir(parents=True)
        driver = root / "drivers" / ("efa" if fabric_name == "efa" else "other")
        driver.mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(driver)
    return sysfs


def run_fabric(tmp: Path, fabric_name: str, devices: list[str], want: int, nccl_line: str,
               *args: str, cloud: str | None = None) -> subprocess.CompletedProcess[str]:
    env_file = tmp / "node.env"
    # node.env names the node's cloud (the trainer contract's GTS_CLOUD): its fragment, infra/clouds/<cloud>/fabric.sh
    cloud = CLOUD_OF_FABRIC.get(fabric_name, "") if cloud is None else cloud
    env_file.write_text(f"GTS_FABRIC={fabric_name}\nGTS_FABRIC_DEVICES={want}\nGTS_IMAGE=trainer@sha256:0\n"
                        f"GTS_CLOUD={cloud}\n")
    stubs = tmp / "bin"
    stubs.mkdir(exist_ok=True)
    if not (tmp / "gts-lib").exists():  # a test may have laid out (and edited) the fragments first
        node_lib(tmp)
    # Stand-ins for what a real node has: docker (prints NCCL's selection line), the installers.
    (stubs / "docker").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp}/docker.args\necho '{nccl_line}'\n")
    for tool in ("curl", "apt-get", "make", "sysctl", "lsmod", "logger"):
        (stubs / tool).write_text(f"#!/bin/sh\necho \"{tool} $*\" >> {tmp}/calls\n")
    # tar unpacks the EFA installer, git clones GDRCopy: each leaves the script the next step runs.
    recorder = f"#!/bin/sh\necho \"$0 $*\" >> {tmp}/calls\n"
    (stubs / "tar").write_text(recorder + 'while [ $# -gt 1 ]; do [ "$1" = -C ] && d=$2; shift; done\n'
                               'mkdir -p "$d/aws-efa-installer"\n'
                               f'printf "#!/bin/sh\\necho efa_installer.sh \\$* >> {tmp}/calls\\n" '
                               '> "$d/aws-efa-installer/efa_installer.sh"\n'
                               'chmod +x "$d/aws-efa-installer/efa_installer.sh"\n'
                               'mkdir -p "$d/erdma_installer"\n'
                               f'printf "#!/bin/sh\\necho install.sh \\$* >> {tmp}/calls\\n" '
                               '> "$d/erdma_installer/install.sh"\n'
                               'chmod +x "$d/erdma_installer/install.sh"\n')
    (stubs / "git").write_text(recorder + 'for a; do d=$a; done\nmkdir -p "$d"\n'
                               f'printf "#!/bin/sh\\necho insmod.sh >> {tmp}/calls\\n" > "$d/insmod.sh"\n'
                               'chmod +x "$d/insmod.sh"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "GTS_ENV_FILE": str(env_file),
           "GTS_SYSFS": str(lay_out(tmp, fabric_name, devices)), "GTS_RUN_DIR": str(tmp / "run"),
           "GTS_ETC_DIR": str(tmp / "etc"), "GTS_DEV_DIR": str(tmp / "dev"), "GTS_LIB_DIR": str(tmp / "gts-lib")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_check_passes_devices_and_limits_to_the_container(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "erdma", ["erdma_0", "erdma_1"], 2, "NCCL INFO NET/IB : Using [0]erdma_0:1/RoCE",
                      "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flags = (tmp_path / "run" / "fabric.args").read_text().split()
    assert f"--device={tmp_path}/dev/infiniband" in flags and "--cap-add=IPC_LOCK" in flags
    assert "--ulimit=memlock=-1:-1" in flags
    assert (tmp_path / "run" / "fabric.env").read_text() == "NCCL_IB_HCA=erdma_0,erdma_1\n"
    probe = (tmp_path / "docker.args").read_text()
    assert "NCCL_DEBUG=INFO" in probe and "--cap-add=IPC_LOCK" in probe
    assert not (tmp_path / "run" / "fabric-failed").exists()


@pytest.mark.parametrize("devices, line, why", [
    (["rdmap0", "rdmap1"], "NET/OFI Selected Provider is efa", "efa sees 2 of 4 devices"),
    (["rdmap0", "rdmap1", "rdmap2", "rdmap3"], "NCCL INFO NET/Socket : Using [0]ens5:10.0.0.5<0>",
     "NCCL did not select efa (NET/Socket : Using [0]ens5"),
])
def test_check_keeps_a_node_out_with_one_line(tmp_path: Path, devices: list[str], line: str, why: str) -> None:
    proc = run_fabric(tmp_path, "efa", devices, 4, line, "check")
    assert proc.returncode == 1
    failed = (tmp_path / "run" / "fabric-failed").read_text()
    assert why in failed and failed.count("\n") == 1
    again = run_fabric(tmp_path, "efa", devices + ["rdmap8", "rdmap9"], 4, "NET/OFI Selected Provider is efa",
                       "check")
    assert again.returncode == 1, "a failed node stays out until it reboots"
    unit = (ROOT / "cloudinit" / "units" / "gts-trainer.service").read_text()
    assert "ConditionPathExists=!/run/gpu-training/fabric-failed" in unit
    assert "ExecStartPre=/usr/local/sbin/gts-fabric.sh check" in unit


def test_install_sets_up_efa_user_space_and_host_limits(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "efa", [], 4, "", "install")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "calls").read_text()
    assert "efa-installer.amazonaws.com/aws-efa-installer-latest.tar.gz" in calls
    assert "efa_installer.sh -y" in calls and "NVIDIA/gdrcopy" in calls and "insmod.sh" in calls
    installs = [line for line in calls.splitlines() if line.startswith("apt-get") and " install " in line]
    assert installs, calls  # GDRCopy's build tools come from apt ...
    # ... through the node scripts' shared apt (cloudinit/scripts/gts-lib.sh), which waits for the
    # dpkg lock instead of failing beside another install at boot.
    assert all("DPkg::Lock::Timeout=600" in line for line in installs), installs
    etc = tmp_path / "etc"
    assert "memlock unlimited" in (etc / "security/limits.d/90-gts-fabric.conf").read_text()
    assert "kernel.yama.ptrace_scope = 0" in (etc / "sysctl.d/90-gts-fabric.conf").read_text()
    bootstrap = (ROOT / "cloudinit" / "scripts" / "gts-bootstrap.sh").read_text()
    assert 'step fabric "$SBIN/gts-fabric.sh" install' in bootstrap


# What each fabric's fragment installs (its fabric_install), as the stand-ins record it.
INSTALLS = {"efa": "efa_installer.sh -y", "erdma": "install.sh --batch", "hcc": "install -y -q rdma-core ibverbs-utils"}


@pytest.mark.parametrize("fabric_name", sorted(CLOUD_OF_FABRIC))
def test_install_runs_each_fabrics_installs_after_the_host_limits(tmp_path: Path, fabric_name: str) -> None:
    proc = run_fabric(tmp_path, fabric_name, [], 1, "", "install")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "memlock unlimited" in (tmp_path / "etc/security/limits.d/90-gts-fabric.conf").read_text()
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    if fabric_name == "hcc" and shutil.which("ibv_devinfo", path="/usr/bin:/bin"):
        assert "rdma-core" not in calls, "the image's verbs tools are kept"
    else:
        assert INSTALLS[fabric_name] in calls, calls
    assert f"installed the {fabric_name} user space" in proc.stdout


def test_a_fabric_that_is_not_the_clouds_is_refused_naming_both(tmp_path: Path) -> None:
    """GTS_FABRIC names the fabric; the node's cloud's fragment says which one it carries
    (FABRIC_KIND): a node told another cloud's fabric stops before doing anything."""
    proc = run_fabric(tmp_path, "efa", ["erdma_0"], 1, "Selected Provider is efa", "install", cloud="alicloud")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "'efa'" in proc.stderr and "'erdma'" in proc.stderr, proc.stderr
    assert not (tmp_path / "calls").exists() and not (tmp_path / "etc").exists()


def test_the_scripts_read_the_fragments_of_their_lib_dir(tmp_path: Path) -> None:
    """The node scripts find a cloud's fragments under GTS_LIB_DIR (the bundle's
    /usr/local/lib/gts on a node): the tests lay out the checkout's there, so a fragment edited
    in that copy is the one that runs."""
    fragment = node_lib(tmp_path) / "clouds" / "aws" / "fabric.sh"
    fragment.write_text(fragment.read_text().replace("FABRIC_SELECTED='Selected Provider is efa'",
                                                     "FABRIC_SELECTED='laid out here'"))
    proc = run_fabric(tmp_path, "efa", ["rdmap0"], 1, "NET/OFI Selected Provider is efa", "check")
    assert proc.returncode == 1 and "NCCL did not select efa" in proc.stdout, proc.stdout + proc.stderr


def test_no_fabric_means_nothing_to_do(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "", [], 0, "", "check")
    assert proc.returncode == 0 and "no fabric" in proc.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cloud", ["", "gcp", "../aws", "aws/x"])
def test_a_fabric_node_of_no_known_cloud_stops_before_doing_anything(tmp_path: Path, cloud: str) -> None:
    """What differs per fabric is the node's cloud's fragment (infra/clouds/<cloud>/fabric.sh,
    found by gts-lib.sh cloud_fragment): a cloud with none, or a name that is no cloud's, is an
    error, never another cloud's fragment or a path outside the folder."""
    proc = run_fabric(tmp_path, "efa", ["rdmap0"], 1, "Selected Provider is efa", "install", cloud=cloud)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not a cloud's name" in proc.stderr or "no fabric.sh for cloud 'gcp'" in proc.stderr
    assert not (tmp_path / "calls").exists() and not (tmp_path / "etc").exists()


def test_an_hcc_group_is_fixed_instances_so_a_faulty_node_is_quarantined_not_handed_back(
        fabric_stack: Any) -> None:
    """HCC nodes are CVM instances in an HCC cluster, in no AS group (TencentGpuFleet): a GPU
    fault must not make them ask a scaling group to replace them (GTS_REPLACE=none); the EFA and
    eRDMA groups scale and hand a faulty node back (infra/resolve/gpu_health.py replace_mode)."""
    from infra.clouds import fixed_instances
    from infra.resolve import gpu_health

    hcc = fabric_stack.group("tc-hcc")
    assert fixed_instances(hcc) == hcc.scaling.max and gpu_health.replace_mode(hcc) == "none"
    ctx = userdata.node_context(fabric_stack.spec, hcc, "img")
    assert "GTS_REPLACE=none" in userdata.render_env(ctx).splitlines()
    for name in ("aws-efa", "ali-erdma"):
        assert gpu_health.replace_mode(fabric_stack.group(name)) == "group", name


def test_nccl_test_runs_one_process_per_gpu_on_each_host(tmp_path: Path) -> None:
    proc = run_fabric(tmp_path, "efa", ["rdmap0s1"], 1, "", "nccl-test", "10.0.0.1,node-b.internal")
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "docker.args").read_text().split()
    assert args[-4:] == ["nccl-test", args[-3], "16", "10.0.0.1:8,node-b.internal:8"], args[-6:]


@pytest.mark.parametrize("hosts", ["10.0.0.1;touch /tmp/x", "10.0.0.1 10.0.0.2", "$(id)", "a,,b", "-H x", ""])
def test_nccl_test_refuses_a_host_list_that_is_not_one(hosts: str, tmp_path: Path) -> None:
    """The hosts reach mpirun inside a privileged container: anything but names and addresses,
    comma-separated, is refused before docker runs."""
    proc = run_fabric(tmp_path, "efa", ["rdmap0s1"], 1, "", "nccl-test", hosts)
    assert proc.returncode != 0 and not (tmp_path / "docker.args").exists(), proc.stderr
