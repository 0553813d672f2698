#!/usr/bin/env bash
# The multi-node fabric of a GPU node (GTS_FABRIC: efa | erdma | hcc; unset: none, nothing to do).
#
#   gts-fabric.sh install   user space and host settings (a bootstrap step, before the runtime):
#                           efa: the EFA installer (libfabric, aws-ofi-nccl, efa module) and
#                           GDRCopy unless the image has them; erdma: Alibaba's erdma installer;
#                           hcc: rdma-core tools (the HCC image brings the mlx5 driver). Then locked
#                           memory unlimited, and ptrace protection off where libfabric needs it.
#   gts-fabric.sh check     before the trainer joins the rendezvous (the trainer unit's
#                           ExecStartPre): the node sees GTS_FABRIC_DEVICES devices, and NCCL in
#                           the trainer image selects the fabric (its NCCL_DEBUG=INFO lines). A
#                           mismatch writes one line to $RUN/fabric-failed, which keeps the
#                           trainer unit from starting on this node again until reboot.
#   gts-fabric.sh nccl-test <host,host,...>   optional: nccl-tests all_reduce_perf between the
#                           group's nodes (README: Multi-node performance lists the bus bandwidth
#                           to expect per type).
#
# Sources: EFA installer and GDRCopy (AWS EFA user guide, efa-start; ParallelCluster efa-v3: ptrace
# protection off on Ubuntu); erdma installer (alibabacloud-erdma-controller pkg/drivers: the
# installer from mirrors.cloud.aliyuncs.com/erdma with ERDMA_CM_NO_BOUND_IF=1 ./install.sh --batch);
# NCCL's selection lines: aws-ofi-nccl "Selected Provider is efa", NCCL "NET/IB : Using [0]erdma_0".
set -euo pipefail

ENV_FILE=${GTS_ENV_FILE:-/etc/gpu-training/node.env}
SYSFS=${GTS_SYSFS:-/sys}
RUN=${GTS_RUN_DIR:-/run/gpu-training}
ETC=${GTS_ETC_DIR:-/etc}
# shellcheck source=/dev/null
[ -r "$ENV_FILE" ] && . "$ENV_FILE"
# apt_get (waits for the dpkg lock, as the driver's and runtime's installs do): the shared shell.
# shellcheck source-path=SCRIPTDIR source=gts-lib.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gts-lib.sh"
FABRIC=${GTS_FABRIC:-}
WANT=${GTS_FABRIC_DEVICES:-0}
EFA_INSTALLER_URL=${GTS_EFA_INSTALLER_URL:-https://efa-installer.amazonaws.com/aws-efa-installer-latest.tar.gz}
ERDMA_INSTALLER_URL=${GTS_ERDMA_INSTALLER_URL:-http://mirrors.cloud.aliyuncs.com/erdma/erdma_installer-latest.tar.gz}
GDRCOPY_TAG=${GTS_GDRCOPY_TAG:-v2.4.4}
NCCL_TESTS_TAG=${GTS_NCCL_TESTS_TAG:-v2.13.11}

log() { echo "gts-fabric: $*"; logger -t gts-fabric -- "$*" 2>/dev/null || true; }

# The fabric's verbs devices this node sees, one name a line.
devices() {
  local dev name driver
  for dev in "$SYSFS"/class/infiniband/*; do
    [ -e "$dev" ] || continue
    name=${dev##*/}
    case $FABRIC in
      efa)
        driver=$(readlink "$dev/device/driver" 2>/dev/null || true)
        [ "${driver##*/}" = efa ] && echo "$name" ;;
      erdma) case $name in erdma_*) echo "$name" ;; esac ;;
      hcc) case $name in mlx5_bond_*) echo "$name" ;; esac ;;
    esac
  done
  return 0
}

host_settings() {
  # Locked memory: RDMA registers (pins) the buffers NCCL sends from.
  mkdir -p "$ETC/security/limits.d" "$ETC/systemd/system.conf.d" "$ETC/sysctl.d"
  printf '* soft memlock unlimited\n* hard memlock unlimited\n' > "$ETC/security/limits.d/90-gts-fabric.conf"
  printf '[Manager]\nDefaultLimitMEMLOCK=infinity\n' > "$ETC/systemd/system.conf.d/90-gts-fabric.conf"
  if [ "$FABRIC" = efa ]; then
    # libfabric's EFA provider uses CMA (process_vm_readv) between local ranks: Ubuntu's Yama
    # ptrace protection (scope 1) blocks it.
    echo 'kernel.yama.ptrace_scope = 0' > "$ETC/sysctl.d/90-gts-fabric.conf"
    sysctl -q -p "$ETC/sysctl.d/90-gts-fabric.conf" 2>/dev/null || true
  fi
}

install_efa() {
  if [ -x /opt/amazon/efa/bin/fi_info ] && /opt/amazon/efa/bin/fi_info -p efa >/dev/null 2>&1; then
    log "efa: the image has the EFA user space (fi_info -p efa)"
  else
    local dir
    dir=$(mktemp -d)
    curl -fsSL --retry 5 "$EFA_INSTALLER_URL" | tar -xz -C "$dir"
    (cd "$dir/aws-efa-installer" && ./efa_installer.sh -y)
    rm -rf "$dir"
  fi
  if lsmod 2>/dev/null | grep -q '^gdrdrv'; then
    log "efa: GDRCopy loaded (gdrdrv)"
  else
    local dir
    dir=$(mktemp -d)
    apt_get install -y -q build-essential devscripts debhelper dkms git >/dev/null
    git clone -q --depth 1 --branch "$GDRCOPY_TAG" https://github.com/NVIDIA/gdrcopy.git "$dir/gdrcopy"
    make -C "$dir/gdrcopy" -s prefix=/opt/gdrcopy install
    (cd "$dir/gdrcopy" && ./insmod.sh)
    rm -rf "$dir"
  fi
}

install_erdma() {
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

install_hcc() {
  # The HCC GPU images carry the Mellanox driver; the verbs tools are what the check reads.
  command -v ibv_devinfo >/dev/null || \
    apt_get install -y -q rdma-core ibverbs-utils >/dev/null
}

# What NCCL must print when it selects the fabric (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET).
selected_pattern() {
  case $FABRIC in
    efa) echo 'Selected Provider is efa' ;;
    erdma) echo 'NET/IB : Using \[0\]erdma' ;;
    hcc) echo 'NET/IB : Using \[0\]mlx5_bond' ;;
  esac
}

refuse() {
  mkdir -p "$RUN"
  echo "$*" > "$RUN/fabric-failed"
  log "$*; this node stays out of the run"
  exit 1
}

check() {
  local seen found hca
  [ -n "$FABRIC" ] || { log "no fabric: nothing to check"; return 0; }
  [ ! -e "$RUN/fabric-failed" ] || refuse "$(cat "$RUN/fabric-failed")"
  mapfile -t seen < <(devices)
  if [ "${#seen[@]}" -lt "$WANT" ]; then
    refuse "fabric check: $FABRIC sees ${#seen[@]} of $WANT devices (${seen[*]:-none})"
  fi
  mkdir -p "$RUN"
  # Settings that differ per node: the devices this one sees (NCCL_IB_HCA narrows the prefix
  # the contract gives). The trainer container gets this file after node.env.
  : > "$RUN/fabric.env"
  if [ "$FABRIC" != efa ]; then
    hca=$(IFS=,; echo "${seen[*]}")
    echo "NCCL_IB_HCA=$hca" >> "$RUN/fabric.env"
  fi
  # The container's devices and limits: the verbs devices, GDRCopy where loaded, locked memory.
  {
    echo "--device=$SYSFS_DEV/infiniband"
    [ -e "$SYSFS_DEV/gdrdrv" ] && echo "--device=$SYSFS_DEV/gdrdrv"
    echo "--cap-add=IPC_LOCK"
    echo "--ulimit=memlock=-1:-1"
    echo "--env-file=$RUN/fabric.env"
  } > "$RUN/fabric.args"  # after node.env on the docker command line: its NCCL_IB_HCA wins
  if [ "${GTS_FABRIC_PROBE:-1}" = 1 ]; then
    # shellcheck disable=SC2046  # one flag a line, none with spaces
    found=$(docker run --rm --gpus all --network host --env-file "$ENV_FILE" $(cat "$RUN/fabric.args") \
      -e NCCL_DEBUG=INFO -e NCCL_DEBUG_SUBSYS=INIT,NET --entrypoint python3 "$GTS_IMAGE" -c \
      'import torch, torch.distributed as d; s = d.HashStore(); d.init_process_group("nccl", store=s, rank=0, world_size=1); d.all_reduce(torch.ones(1, device="cuda")); d.destroy_process_group()' \
      2>&1 || true)
    if ! grep -q "$(selected_pattern)" <<<"$found"; then
      refuse "fabric check: NCCL did not select $FABRIC ($(grep -m1 -o 'NET/[A-Za-z]* : Using[^;]*' <<<"$found" || echo 'no NET line'))"
    fi
  fi
  log "fabric check: $FABRIC with ${#seen[@]} devices (${seen[*]}); NCCL selects it"
}

nccl_test() {
  local hosts=$1 per=${NPROC_PER_NODE:-8} slots="" host
  [ -n "$FABRIC" ] || { echo "gts-fabric: this node has no fabric" >&2; exit 2; }
  # Host names or addresses, comma-separated, nothing else: the list reaches mpirun inside a
  # privileged container.
  if ! [[ $hosts =~ ^[A-Za-z0-9.:-]+(,[A-Za-z0-9.:-]+)*$ ]]; then
    echo "gts-fabric: nccl-test takes host1,host2,... (names or addresses); got '$hosts'" >&2; exit 2
  fi
  [[ $per =~ ^[1-9][0-9]*$ ]] || { echo "gts-fabric: NPROC_PER_NODE must be a count of GPUs; got '$per'" >&2; exit 2; }
  IFS=, read -ra list <<<"$hosts"
  for host in "${list[@]}"; do slots+="${slots:+,}$host:$per"; done
  # nccl-tests built in the trainer image (NGC PyTorch brings MPI and NCCL), run across the nodes,
  # one process per GPU; the hosts reach the command as arguments, never as its text.
  # shellcheck disable=SC2046  # one flag a line, none with spaces
  docker run --rm --gpus all --network host --ipc host --env-file "$ENV_FILE" $(cat "$RUN/fabric.args") \
    --entrypoint bash "$GTS_IMAGE" -c 'git clone -q --depth 1 --branch "$1" \
      https://github.com/NVIDIA/nccl-tests.git /tmp/nccl-tests && make -s -C /tmp/nccl-tests MPI=1 \
      MPI_HOME=/usr/local/mpi && mpirun --allow-run-as-root -np "$2" -H "$3" -x NCCL_DEBUG=INFO \
      /tmp/nccl-tests/build/all_reduce_perf -b 8 -e 8G -f 2 -g 1' \
    nccl-test "$NCCL_TESTS_TAG" "$(( ${#list[@]} * per ))" "$slots"
}

SYSFS_DEV=${GTS_DEV_DIR:-/dev}
case ${1:-} in
  install)
    [ -n "$FABRIC" ] || { log "no fabric: nothing to install"; exit 0; }
    host_settings
    "install_$FABRIC"
    log "installed the $FABRIC user space" ;;
  check) check ;;
  nccl-test) nccl_test "${2:?usage: gts-fabric.sh nccl-test host1,host2,...}" ;;
  *) echo "usage: gts-fabric.sh install|check|nccl-test HOSTS" >&2; exit 2 ;;
esac
