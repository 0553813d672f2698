# shellcheck shell=bash
# Alibaba Cloud's fabric on a node, eRDMA: sourced (never run) by cloudinit/scripts/gts-fabric.sh,
# which calls these on a node of a fabric group (GTS_CLOUD=alicloud). Sources: the erdma installer
# (alibabacloud-erdma-controller pkg/drivers: the installer from mirrors.cloud.aliyuncs.com/erdma
# with ERDMA_CM_NO_BOUND_IF=1 ./install.sh --batch); NCCL's selection line "NET/IB : Using [0]erdma_0".

ERDMA_INSTALLER_URL=${GTS_ERDMA_INSTALLER_URL:-http://mirrors.cloud.aliyuncs.com/erdma/erdma_installer-latest.tar.gz}
# Read by gts-fabric.sh, which sources this: the fabric kind (the profile's `fabric`; GTS_FABRIC must
# name it), the line NCCL prints when it selects the fabric
# (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET), and whether the node narrows NCCL_IB_HCA to the
# devices it sees (1: they differ per node).
# shellcheck disable=SC2034
FABRIC_KIND=erdma
# shellcheck disable=SC2034
FABRIC_SELECTED='NET/IB : Using \[0\]erdma'
# shellcheck disable=SC2034
FABRIC_NARROWS_HCA=1

# Whether a verbs device (its sysfs folder) is one of the fabric's.
fabric_device() {
  case ${1##*/} in erdma_*) return 0 ;; esac
  return 1
}

fabric_host_settings() { :; }

# Alibaba's erdma installer, unless the image has the driver and user space.
fabric_install() {
  if [ -n "$(devices)" ] && command -v ibv_devinfo >/dev/null; then
    log "erdma: the image has the erdma driver and user space"
    return 0
  fi
  local dir
  dir=$(mktemp -d)
  apt_get install -y -q debhelper autotools-dev dkms libnl-3-dev \
    libnl-route-3-dev cmake >/dev/null
  curl -fsSL --retry 5 "$ERDMA_INSTALLER_URL" | tar -xz -C "$dir"
  # The installer's OFED-compatible user space (rdma-core providers NCCL loads); the ACK eRDMA
  # controller's preferDriver: ofed installs the same on cluster nodes.
  (cd "$dir/erdma_installer" && ERDMA_CM_NO_BOUND_IF=1 ./install.sh --batch)
  rm -rf "$dir"
}
