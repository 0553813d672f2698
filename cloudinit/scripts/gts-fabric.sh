#!/usr/bin/env bash
# The multi-node fabric of a GPU node (GTS_FABRIC: its cloud's fabric kind; unset: none, nothing to do).
#
#   gts-fabric.sh install   user space and host settings (a bootstrap step, before the runtime):
#                           locked memory unlimited, then what the node's cloud installs for its
#                           fabric (its fragment's fabric_host_settings and fabric_install).
#   gts-fabric.sh check     before the trainer joins the rendezvous (the trainer unit's
#                           ExecStartPre): the node sees GTS_FABRIC_DEVICES devices, and NCCL in
#                           the trainer image selects the fabric (its NCCL_DEBUG=INFO lines). A
#                           mismatch writes one line to $RUN/fabric-failed, which keeps the
#                           trainer unit from starting on this node again until reboot.
#   gts-fabric.sh nccl-test <host,host,...>   optional: nccl-tests all_reduce_perf between the
#                           group's nodes (README: Multi-node performance lists the bus bandwidth
#                           to expect per type).
#
# What differs per fabric is the node's cloud's fragment, infra/clouds/<cloud>/fabric.sh (on a
# node /usr/local/lib/gts/clouds/<cloud>/fabric.sh, from the bundle), with its sources: which
# verbs devices are the fabric's (fabric_device), its kind (FABRIC_KIND, which GTS_FABRIC must
# name), its host settings and installs (fabric_host_settings, fabric_install), the line NCCL
# prints when it selects it (FABRIC_SELECTED) and whether the node narrows NCCL_IB_HCA to the
# devices it sees (FABRIC_NARROWS_HCA).
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
NCCL_TESTS_TAG=${GTS_NCCL_TESTS_TAG:-v2.13.11}

log() { echo "gts-fabric: $*"; logger -t gts-fabric -- "$*" 2>/dev/null || true; }

if [ -n "$FABRIC" ]; then
  FRAGMENT=$(cloud_fragment fabric.sh)
  # shellcheck source-path=SCRIPTDIR source=../../infra/clouds/aws/fabric.sh
  . "$FRAGMENT"
  if [ "$FABRIC" != "$FABRIC_KIND" ]; then
    echo "gts-fabric: GTS_FABRIC '$FABRIC' is not this cloud's fabric '$FABRIC_KIND' ($FRAGMENT)" >&2
    exit 2
  fi
fi

# The fabric's verbs devices this node sees, one name a line.
devices() {
  local dev
  for dev in "$SYSFS"/class/infiniband/*; do
    [ -e "$dev" ] || continue
    fabric_device "$dev" && echo "${dev##*/}"
  done
  return 0
}

host_settings() {
  # Locked memory: RDMA registers (pins) the buffers NCCL sends from.
  mkdir -p "$ETC/security/limits.d" "$ETC/systemd/system.conf.d" "$ETC/sysctl.d"
  printf '* soft memlock unlimited\n* hard memlock unlimited\n' > "$ETC/security/limits.d/90-gts-fabric.conf"
  printf '[Manager]\nDefaultLimitMEMLOCK=infinity\n' > "$ETC/systemd/system.conf.d/90-gts-fabric.conf"
  fabric_host_settings
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
  if [ "$FABRIC_NARROWS_HCA" = 1 ]; then
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
    if ! grep -q "$FABRIC_SELECTED" <<<"$found"; then
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
    fabric_install
    log "installed the $FABRIC user space" ;;
  check) check ;;
  nccl-test) nccl_test "${2:?usage: gts-fabric.sh nccl-test host1,host2,...}" ;;
  *) echo "usage: gts-fabric.sh install|check|nccl-test HOSTS" >&2; exit 2 ;;
esac
