"""Each cloud's node fragments (infra/clouds/<cloud>/fabric.sh, shared.sh) define what the generic
node scripts (cloudinit/scripts/gts-fabric.sh, gts-shared.sh) use of them: sourced in bash under
`set -euo pipefail`, the functions are defined and the variables set. What gts-fabric.sh uses is
read from its code, so a new call or read is covered as it is written."""

from __future__ import annotations

import re
import subprocess

import pytest

from infra import clouds
from tests.harness import ROOT
from tests.shell_code import shell_code

SCRIPTS = ROOT / "cloudinit" / "scripts"
# What the node scripts define themselves (the fragments may call these: log, apt_get, devices).
OWN_FUNCTION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(\)", re.M)
OWN_VARIABLE = re.compile(r"(?:^|[\s;(])(?:local\s+|export\s+)?([A-Z_][A-Z0-9_]*)=", re.M)
# gts-shared.sh client() mounts these kernel types itself (its `nfs|nfs4)` case); any other comes
# from the cloud's shared.sh as shared_client_<mount type>.
GENERIC_MOUNTS = ("nfs", "nfs4")


def _code(name: str) -> str:
    return shell_code((SCRIPTS / name).read_text())


def fabric_functions(code: str) -> list[str]:
    """The fabric_* functions a script calls and does not define: its fragment's."""
    own = set(OWN_FUNCTION.findall(code))
    return sorted({n for n in re.findall(r"(?<![\w$-])(fabric_[a-z0-9_]+)\b", code)} - own)


def fabric_variables(code: str) -> list[str]:
    """The FABRIC_* variables a script reads and does not set: its fragment's."""
    own = set(OWN_VARIABLE.findall(code))
    return sorted({n for n in re.findall(r"\$\{?(FABRIC_[A-Z0-9_]+)", code)} - own)


def sourced(cloud: str, part: str, functions: list[str], variables: list[str]) -> subprocess.CompletedProcess[str]:
    """Source the cloud's fragment as the node scripts do; print each variable as NAME=value and
    fail naming the first function or variable that is missing."""
    script = (
        "set -euo pipefail\n"
        f'. "{ROOT}/infra/clouds/{cloud}/{part}"\n'
        'for f in ${FUNCS}; do declare -F "$f" >/dev/null || { echo "no function $f" >&2; exit 3; }; done\n'
        'for v in ${VARS}; do [ -n "${!v+x}" ] || { echo "no variable $v" >&2; exit 3; }; '
        'printf "%s=%s\\n" "$v" "${!v}"; done\n')
    env = {"PATH": "/usr/bin:/bin", "FUNCS": " ".join(functions), "VARS": " ".join(variables)}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)


def test_what_gts_fabric_uses_of_a_fragment_is_read_from_its_code() -> None:
    code = _code("gts-fabric.sh")
    functions, variables = fabric_functions(code), fabric_variables(code)
    assert {"fabric_device", "fabric_host_settings", "fabric_install"} <= set(functions), functions
    assert {"FABRIC_KIND", "FABRIC_SELECTED", "FABRIC_NARROWS_HCA"} <= set(variables), variables
    # what the reader must see: a call, a read; never the script's own definitions or a comment
    planted = code + '\nfabric_new_step "$x"\nhelper() { :; }\nfabric_own() { :; }\nfabric_own\n' \
        'echo "$FABRIC_NEW_LINE"\nFABRIC_MINE=1\necho "${FABRIC_MINE}"\n# fabric_commented\n'
    assert set(fabric_functions(shell_code(planted))) - set(functions) == {"fabric_new_step"}
    assert set(fabric_variables(shell_code(planted))) - set(variables) == {"FABRIC_NEW_LINE"}


@pytest.mark.parametrize("cloud", clouds.NAMES)
def test_each_fabric_fragment_defines_what_gts_fabric_uses(cloud: str) -> None:
    code = _code("gts-fabric.sh")
    proc = sourced(cloud, "fabric.sh", fabric_functions(code), fabric_variables(code))
    assert proc.returncode == 0, proc.stderr
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert values["FABRIC_NARROWS_HCA"] in ("0", "1"), values
    assert values["FABRIC_SELECTED"], "NCCL's selection line"
    # the kind GTS_FABRIC must name (gts-fabric.sh refuses another) is the profile's
    assert values["FABRIC_KIND"] == clouds.profile(cloud).fabric, values


@pytest.mark.parametrize("cloud", clouds.NAMES)
def test_each_shared_fragment_has_a_client_for_each_mount_type_it_offers(cloud: str) -> None:
    assert "nfs|nfs4)" in _code("gts-shared.sh"), "GENERIC_MOUNTS is gts-shared.sh's own case"
    types = sorted({k.mount_type for k in clouds.profile(cloud).shared_fs_kinds} - set(GENERIC_MOUNTS))
    proc = sourced(cloud, "shared.sh", [f"shared_client_{t}" for t in types], [])
    assert proc.returncode == 0, proc.stderr


def test_a_missing_function_or_variable_is_caught() -> None:
    """The check can fail: a name the fragment lacks is reported."""
    for functions, variables, missing in ((["fabric_nowhere"], [], "no function fabric_nowhere"),
                                          ([], ["FABRIC_NOWHERE"], "no variable FABRIC_NOWHERE")):
        proc = sourced(clouds.NAMES[0], "fabric.sh", functions, variables)
        assert proc.returncode == 3 and missing in proc.stderr, proc.stderr
