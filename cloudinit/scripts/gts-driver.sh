#!/usr/bin/env bash
# Install the pinned NVIDIA driver with the image's own package manager, unless one works.
# Exit 0: a driver works. Exit 100: installed, reboot needed. Anything else: failure.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"

BRANCH=${GTS_DRIVER_BRANCH:-535}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  echo "gts-driver: nvidia-smi works; keeping the image's driver"
  exit 0
fi

# shellcheck source=/dev/null
. /etc/os-release
case "${ID:-unknown}" in
  ubuntu|debian)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "linux-headers-$(uname -r)" "nvidia-driver-${BRANCH}-server" "nvidia-utils-${BRANCH}-server"
    if [ "${GTS_NVSWITCH:-false}" = "true" ]; then
      apt-get install -y -q "nvidia-fabricmanager-${BRANCH}"
      systemctl enable nvidia-fabricmanager
    fi
    ;;
  alinux|tencentos|centos|rhel|rocky|almalinux|opencloudos)
    major=${VERSION_ID%%.*}
    repo=${GTS_NVIDIA_REPO:-https://developer.download.nvidia.com/compute/cuda/repos}
    dnf install -y -q dnf-plugins-core "kernel-devel-$(uname -r)" "kernel-headers-$(uname -r)"
    dnf config-manager --add-repo "${repo}/rhel${major}/x86_64/cuda-rhel${major}.repo"
    dnf module install -y -q "nvidia-driver:${BRANCH}-dkms"
    if [ "${GTS_NVSWITCH:-false}" = "true" ]; then
      dnf install -y -q "nvidia-fabric-manager-${BRANCH}*"
      systemctl enable nvidia-fabricmanager
    fi
    ;;
  *)
    echo "gts-driver: no driver recipe for image ID '${ID:-unknown}'; use a GPU image" >&2
    exit 1
    ;;
esac
exit 100
