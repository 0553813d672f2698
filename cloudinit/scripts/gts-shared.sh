#!/usr/bin/env bash
# The network's shared file system (networks[].sharedFs) at GTS_SHARED_DIR, on every boot:
# installs the client the type needs (NFS: nfs-common; another type: the node's cloud's client,
# infra/clouds/<cloud>/shared.sh, such as AWS's EFS mount helper and Lustre client), waits for
# the file system's address to resolve (a new mount target takes minutes to appear in DNS) and
# mounts it, retrying; the trainer unit requires this one, so a
# node never trains with a missing shared directory. Nothing to do when the group mounts none.
# The file system's root is then given to the trainer's uid (the image's USER 1000), which runs
# unprivileged. `--prepare` (cluster nodes, whose pods mount it through a PersistentVolume and
# cannot chown) mounts it, hands the root over and unmounts it again.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"
ATTEMPTS=${GTS_SHARED_ATTEMPTS:-30}
MOUNT=${GTS_MOUNT:-mount}
TRAINER_UID=${GTS_TRAINER_UID:-1000}
PREPARE=${1:-}

log() { echo "gts-shared: $*"; logger -t gts-shared -- "$*" 2>/dev/null || true; }

if [ -z "${GTS_SHARED_FS:-}" ]; then
  log "no shared file system for this group"
  exit 0
fi
: "${GTS_SHARED_SOURCE:?}" "${GTS_SHARED_DIR:?}" "${GTS_SHARED_OPTIONS:?}"

# apt_get (waits for the dpkg lock) and apt_update (retried): the node scripts' shared shell.
# shellcheck source-path=SCRIPTDIR source=gts-lib.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gts-lib.sh"

client() {
  export DEBIAN_FRONTEND=noninteractive
  case "$GTS_SHARED_FS" in
    nfs|nfs4)
      command -v mount.nfs >/dev/null 2>&1 && return 0
      if command -v apt-get >/dev/null 2>&1; then
        apt_update && apt_get install -y -q nfs-common
      else
        yum install -y -q nfs-utils  # EKS AL2023 (dnf), TKE tlinux / ACK Alibaba Cloud Linux (yum)
      fi
      ;;
    *)
      # Another kernel type is the node's cloud's (infra/clouds/<cloud>/shared.sh defines
      # shared_client_<type>: AWS's EFS mount helper and Lustre client); none there: refused.
      local fragment
      fragment=$(cloud_fragment shared.sh)
      # shellcheck source-path=SCRIPTDIR source=../../infra/clouds/aws/shared.sh
      . "$fragment"
      if ! declare -F "shared_client_$GTS_SHARED_FS" >/dev/null; then
        log "unknown shared file system type '$GTS_SHARED_FS'"
        exit 2
      fi
      "shared_client_$GTS_SHARED_FS"
      ;;
  esac
}

host_of() {
  local source=$1
  source=${source%%:*}
  echo "${source%%@*}"
}

hand_over() {
  if [ "$(stat -c %u "$1")" != "$TRAINER_UID" ]; then
    chown "$TRAINER_UID:$TRAINER_UID" "$1"
    chmod 0775 "$1"
    log "the root of the shared file system now belongs to uid $TRAINER_UID (the trainer)"
  fi
}

mount_it() {
  local dir=$1 host try
  host=$(host_of "$GTS_SHARED_SOURCE")
  for try in $(seq 1 "$ATTEMPTS"); do
    if getent hosts "$host" >/dev/null 2>&1 && \
       $MOUNT -t "$GTS_SHARED_FS" -o "$GTS_SHARED_OPTIONS" "$GTS_SHARED_SOURCE" "$dir"; then
      log "mounted $GTS_SHARED_SOURCE at $dir ($GTS_SHARED_FS)"
      return 0
    fi
    log "$GTS_SHARED_SOURCE not mountable yet (try $try of $ATTEMPTS); retrying in 20 s"
    sleep 20
  done
  log "could not mount $GTS_SHARED_SOURCE"
  return 1
}

client
if [ "$PREPARE" = --prepare ]; then
  dir=$(mktemp -d)
  mount_it "$dir"
  hand_over "$dir"
  umount "$dir" && rmdir "$dir"
  exit 0
fi
mkdir -p "$GTS_SHARED_DIR"
if mountpoint -q "$GTS_SHARED_DIR"; then
  # Mounted already (this unit ran before this boot's restart): only if it is this file system's
  # kind; anything else there (a local disk, a tmpfs) would take the shared data silently.
  fstype=$(findmnt -n -o FSTYPE --mountpoint "$GTS_SHARED_DIR" 2>/dev/null || true)
  case "$fstype" in
    "$GTS_SHARED_FS"|nfs|nfs4) ;;  # an EFS mount (mount.efs) shows as nfs4
    *) log "$GTS_SHARED_DIR is already a '$fstype' mount, not the shared file system ($GTS_SHARED_FS)"; exit 1 ;;
  esac
else
  mount_it "$GTS_SHARED_DIR"
fi
hand_over "$GTS_SHARED_DIR"
