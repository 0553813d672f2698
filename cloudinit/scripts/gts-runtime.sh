#!/usr/bin/env bash
# Docker with the NVIDIA container toolkit, and package / registry mirrors when configured.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"
# shellcheck source=/dev/null
. /etc/os-release

if [ -n "${GTS_PIP_MIRROR:-}" ]; then
  printf '[global]\nindex-url = %s\n' "$GTS_PIP_MIRROR" > /etc/pip.conf
fi

case "${ID:-unknown}" in
  ubuntu|debian)
    export DEBIAN_FRONTEND=noninteractive
    if [ -n "${GTS_APT_MIRROR:-}" ]; then
      sed -i -E "s#https?://[^ ]*(archive|security)\.ubuntu\.com/ubuntu#${GTS_APT_MIRROR}#g" \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true
    fi
    if ! command -v docker >/dev/null 2>&1; then
      apt-get update -q
      apt-get install -y -q docker.io
    fi
    if ! command -v nvidia-ctk >/dev/null 2>&1; then
      curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
        | gpg --dearmor -o /usr/share/keyrings/nvidia-container-toolkit.gpg
      curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
        | sed 's#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit.gpg] https://#' \
        > /etc/apt/sources.list.d/nvidia-container-toolkit.list
      apt-get update -q
      apt-get install -y -q nvidia-container-toolkit
    fi
    ;;
  *)
    if [ -n "${GTS_YUM_MIRROR:-}" ]; then
      echo "gts-runtime: yum mirror ${GTS_YUM_MIRROR} is set in the image's repo files by the image owner"
    fi
    if ! command -v docker >/dev/null 2>&1; then
      dnf install -y -q docker || dnf install -y -q moby-engine
    fi
    if ! command -v nvidia-ctk >/dev/null 2>&1; then
      curl -fsSL https://nvidia.github.io/libnvidia-container/stable/rpm/nvidia-container-toolkit.repo \
        > /etc/yum.repos.d/nvidia-container-toolkit.repo
      dnf install -y -q nvidia-container-toolkit
    fi
    ;;
esac

mkdir -p /etc/docker
if [ -n "${GTS_REGISTRY_MIRROR:-}" ]; then
  printf '{"registry-mirrors": ["https://%s"], "log-driver": "journald"}\n' "$GTS_REGISTRY_MIRROR" > /etc/docker/daemon.json
else
  printf '{"log-driver": "journald"}\n' > /etc/docker/daemon.json
fi
nvidia-ctk runtime configure --runtime=docker
systemctl enable docker
systemctl restart docker
