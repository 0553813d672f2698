# shellcheck shell=bash
# AWS's fabric on a node, EFA: sourced (never run) by cloudinit/scripts/gts-fabric.sh, which calls
# these on a node of a fabric group (GTS_CLOUD=aws). Sources: the EFA installer and GDRCopy (AWS EFA
# user guide, efa-start; ParallelCluster efa-v3: ptrace protection off on Ubuntu); NCCL's selection
# line: aws-ofi-nccl "Selected Provider is efa".

EFA_INSTALLER_URL=${GTS_EFA_INSTALLER_URL:-https://efa-installer.amazonaws.com/aws-efa-installer-latest.tar.gz}
GDRCOPY_TAG=${GTS_GDRCOPY_TAG:-v2.4.4}
# Read by gts-fabric.sh, which sources this: the fabric kind (the profile's `fabric`; GTS_FABRIC must
# name it), the line NCCL prints when it selects the fabric
# (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET), and whether the node narrows NCCL_IB_HCA to the
# devices it sees (0: aws-ofi-nccl finds the EFA devices itself).
# shellcheck disable=SC2034
FABRIC_KIND=efa
# shellcheck disable=SC2034
FABRIC_SELECTED='Selected Provider is efa'
# shellcheck disable=SC2034
FABRIC_NARROWS_HCA=0

# Whether a verbs device (its sysfs folder) is one of the fabric's: bound to the efa driver.
fabric_device() {
  local driver
  driver=$(readlink "$1/device/driver" 2>/dev/null || true)
  [ "${driver##*/}" = efa ]
}

fabric_host_settings() {
  # libfabric's EFA provider uses CMA (process_vm_readv) between local ranks: Ubuntu's Yama
  # ptrace protection (scope 1) blocks it.
  echo 'kernel.yama.ptrace_scope = 0' > "$ETC/sysctl.d/90-gts-fabric.conf"
  sysctl -q -p "$ETC/sysctl.d/90-gts-fabric.conf" 2>/dev/null || true
}

# The EFA installer (libfabric, aws-ofi-nccl, efa module) and GDRCopy unless the image has them.
fabric_install() {
  local dir
  if [ -x /opt/amazon/efa/bin/fi_info ] && /opt/amazon/efa/bin/fi_info -p efa >/dev/null 2>&1; then
    log "efa: the image has the EFA user space (fi_info -p efa)"
  else
    dir=$(mktemp -d)
    curl -fsSL --retry 5 "$EFA_INSTALLER_URL" | tar -xz -C "$dir"
    (cd "$dir/aws-efa-installer" && ./efa_installer.sh -y)
    rm -rf "$dir"
  fi
  if lsmod 2>/dev/null | grep -q '^gdrdrv'; then
    log "efa: GDRCopy loaded (gdrdrv)"
  else
    dir=$(mktemp -d)
    apt_get install -y -q build-essential devscripts debhelper dkms git >/dev/null
    git clone -q --depth 1 --branch "$GDRCOPY_TAG" https://github.com/NVIDIA/gdrcopy.git "$dir/gdrcopy"
    make -C "$dir/gdrcopy" -s prefix=/opt/gdrcopy install
    (cd "$dir/gdrcopy" && ./insmod.sh)
    rm -rf "$dir"
  fi
}
