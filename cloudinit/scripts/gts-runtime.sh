#!/usr/bin/env bash
# Docker with the NVIDIA container toolkit (the AWS Deep Learning AMI ships both), and the
# package / Docker Hub mirrors the stack names for nodes that cannot reach the public ones.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"
OS_RELEASE=${GTS_OS_RELEASE:-/etc/os-release}
ETC=${GTS_ETC:-/etc}
# shellcheck source=/dev/null
. "$OS_RELEASE"

# apt_get (waits for the dpkg lock) and apt_update (retried): the node scripts' shared shell.
# shellcheck source-path=SCRIPTDIR source=gts-lib.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gts-lib.sh"

case "${ID:-unknown}" in
  ubuntu|debian) ;;
  *) echo "gts-runtime: the stack boots Ubuntu 22.04 VMs, not '${ID:-unknown}'" >&2; exit 1 ;;
esac
export DEBIAN_FRONTEND=noninteractive
if [ -n "${GTS_APT_MIRROR:-}" ]; then
  sed -i -E "s#https?://[^ ]*(archive|security)\.ubuntu\.com/ubuntu#${GTS_APT_MIRROR}#g" \
    "$ETC/apt/sources.list" 2>/dev/null || true
fi
if ! command -v docker >/dev/null 2>&1; then
  apt_update
  apt_get install -y -q docker.io
fi
# The rendezvous store (GTS_MODE=rendezvous) runs on a small instance without GPUs.
GPU_NODE=true
if [ "${GTS_MODE:-vm}" = rendezvous ]; then GPU_NODE=false; fi
if $GPU_NODE && ! command -v nvidia-ctk >/dev/null 2>&1; then
  # The toolkit's apt repository, or the stack's mirror of it (China-region nodes).
  repo=${GTS_NVIDIA_MIRROR:-https://nvidia.github.io/libnvidia-container}
  keyring=$ETC/apt/keyrings/nvidia-container-toolkit.gpg
  mkdir -p "$(dirname "$keyring")"
  # --batch --yes: a retried step overwrites the key instead of failing without a tty.
  curl -fsSL "$repo/gpgkey" | gpg --batch --yes --dearmor -o "$keyring"
  echo "deb [signed-by=$keyring] $repo/stable/deb/\$(ARCH) /" > "$ETC/apt/sources.list.d/nvidia-container-toolkit.list"
  apt_update
  apt_get install -y -q nvidia-container-toolkit
fi

mkdir -p "$ETC/docker"
# registry-mirrors mirrors Docker Hub only (Docker docs, "Registry as a pull through cache"):
# the stack's own images are pulled by their full name from the node's cloud registry.
if [ -n "${GTS_DOCKERHUB_MIRROR:-}" ]; then
  printf '{"registry-mirrors": ["%s"], "log-driver": "journald"}\n' "$GTS_DOCKERHUB_MIRROR" > "$ETC/docker/daemon.json"
else
  printf '{"log-driver": "journald"}\n' > "$ETC/docker/daemon.json"
fi
if $GPU_NODE; then nvidia-ctk runtime configure --runtime=docker; fi
systemctl enable docker
systemctl restart docker
