#!/usr/bin/env bash
# The pinned NVIDIA driver with the image's own package manager, unless one works already.
# Exit 0: a driver works, or one was installed and $STATE/reboot-required asks for the reboot.
# Anything else is a failure (apt-get's own exit 100 included: it means "an error occurred",
# apt-get(8), never "installed"), and the bootstrap retries the step.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"
STATE=${GTS_STATE_DIR:-/var/lib/gpu-training}
OS_RELEASE=${GTS_OS_RELEASE:-/etc/os-release}
BRANCH=${GTS_DRIVER_BRANCH:-535}

ETC=${GTS_ETC:-/etc}

# nvidia-smi(1) RETURN VALUE: 9 "the NVIDIA driver is not loaded", 12 "NVML shared library couldn't
# be found or loaded": no usable driver, install one. Any other answer comes from a loaded driver
# (6 "the query was unsuccessful" is "No devices were found": a GPU lost from the bus; 15 "a GPU
# has fallen off the bus"): reinstalling cannot bring devices back, so keep the driver and let
# the GPU boot gate judge the devices and ask for a replacement.
if command -v nvidia-smi >/dev/null 2>&1; then
  rc=0
  nvidia-smi >/dev/null 2>&1 || rc=$?
  case $rc in
    0) echo "gts-driver: nvidia-smi works; keeping the image's driver"; exit 0 ;;
    9|12) echo "gts-driver: nvidia-smi exits $rc: no driver loaded; installing it" ;;
    *) echo "gts-driver: nvidia-smi exits $rc with a driver loaded (6: no devices found); keeping the driver, the GPU gate judges the devices"
       exit 0 ;;
  esac
fi

# apt_get (waits for the dpkg lock) and apt_update (retried): the node scripts' shared shell.
# shellcheck source-path=SCRIPTDIR source=gts-lib.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gts-lib.sh"

# shellcheck source=/dev/null
. "$OS_RELEASE"
case "${ID:-unknown}" in
  ubuntu|debian)
    export DEBIAN_FRONTEND=noninteractive
    # The stack's package mirror (nodes that cannot reach Ubuntu's archive), before the first
    # apt-get: gts-runtime.sh applies it too, but runs after this step.
    if [ -n "${GTS_APT_MIRROR:-}" ]; then
      sed -i -E "s#https?://[^ ]*(archive|security)\.ubuntu\.com/ubuntu#${GTS_APT_MIRROR}#g" \
        "$ETC/apt/sources.list" 2>/dev/null || true
    fi
    apt_update
    apt_get install -y -q "linux-headers-$(uname -r)" "nvidia-driver-${BRANCH}-server" "nvidia-utils-${BRANCH}-server"
    if [ "${GTS_NVSWITCH:-false}" = "true" ]; then
      # Fabric Manager must be exactly the driver's version (NVIDIA Fabric Manager user guide),
      # or CUDA fails on NVSwitch systems: pin it to what was just installed.
      version=$(dpkg-query -W -f='${Version}' "nvidia-utils-${BRANCH}-server")
      apt_get install -y -q "nvidia-fabricmanager-${BRANCH}=${version}"
      systemctl enable nvidia-fabricmanager
    fi
    ;;
  *)
    echo "gts-driver: no driver recipe for image ID '${ID:-unknown}'; the stack boots Ubuntu 22.04 VMs" >&2
    exit 1
    ;;
esac
mkdir -p "$STATE"
touch "$STATE/reboot-required"
echo "gts-driver: driver ${BRANCH} installed; a reboot loads it"
