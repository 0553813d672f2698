# shellcheck shell=bash
# Tencent Cloud's fabric on a node, HCC RDMA: sourced (never run) by cloudinit/scripts/gts-fabric.sh,
# which calls these on a node of a fabric group (GTS_CLOUD=tencentcloud). NCCL's selection line:
# "NET/IB : Using [0]mlx5_bond_0".

# Read by gts-fabric.sh, which sources this: the fabric kind (the profile's `fabric`; GTS_FABRIC must
# name it), the line NCCL prints when it selects the fabric
# (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET), and whether the node narrows NCCL_IB_HCA to the
# devices it sees (1: they differ per node).
# shellcheck disable=SC2034
FABRIC_KIND=hcc
# shellcheck disable=SC2034
FABRIC_SELECTED='NET/IB : Using \[0\]mlx5_bond'
# shellcheck disable=SC2034
FABRIC_NARROWS_HCA=1

# Whether a verbs device (its sysfs folder) is one of the fabric's: the bonded Mellanox ports.
fabric_device() {
  case ${1##*/} in mlx5_bond_*) return 0 ;; esac
  return 1
}

fabric_host_settings() { :; }

# The HCC GPU images carry the Mellanox driver; the verbs tools are what the check reads.
fabric_install() {
  command -v ibv_devinfo >/dev/null || \
    apt_get install -y -q rdma-core ibverbs-utils >/dev/null
}
