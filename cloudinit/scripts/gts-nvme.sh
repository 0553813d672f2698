#!/usr/bin/env bash
# Scratch space at one fixed path, on every boot (idempotent): an instance store the image has
# already assembled (the AWS Deep Learning AMI mounts it at /opt/dlami/nvme) is bind-mounted;
# otherwise RAID0 over the local NVMe (or data) disks when there are several, XFS, nofail. Nothing
# destructive on a re-run: an array or filesystem labelled gts-scratch is reused as it is, and
# one lost with the instance store (stop / start) is rebuilt.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"

MOUNT=${GTS_SCRATCH_DIR:-/scratch}
DLAMI_NVME=${GTS_DLAMI_NVME:-/opt/dlami/nvme}
LABEL=gts-scratch
MD=/dev/md/gts-scratch
PICKER=${GTS_DISK_PICKER:-/usr/local/sbin/gts-disks.py}
FSTAB=${GTS_FSTAB:-/etc/fstab}
# The training image runs as this uid (training/Dockerfile USER): its checkpoint and dataset
# folders on scratch are its own, whichever way scratch was made.
TRAINER_UID=${GTS_TRAINER_UID:-1000}
mkdir -p "$MOUNT"

ready() {
  chmod 1777 "$MOUNT"
  install -d -o "$TRAINER_UID" -g "$TRAINER_UID" -m 0755 "$MOUNT/checkpoints" "$MOUNT/datasets"
  echo "gts-nvme: $1"
  exit 0
}

if mountpoint -q "$MOUNT"; then
  ready "$MOUNT already mounted"
fi

if mountpoint -q "$DLAMI_NVME"; then
  mount --bind "$DLAMI_NVME" "$MOUNT"
  ready "$DLAMI_NVME (the AMI's instance store) bind-mounted at $MOUNT"
fi

existing=$(blkid -L "$LABEL" 2>/dev/null || true)
if [ -z "$existing" ]; then
  # A failing picker (no lsblk --json, no python3) stops the step instead of reading as "no disks".
  picked=$("$PICKER")
  disks=()
  if [ -n "$picked" ]; then mapfile -t disks <<< "$picked"; fi
  if [ "${#disks[@]}" -eq 0 ]; then
    ready "no free NVMe or data disk; scratch stays on the root disk at $MOUNT"
  fi
  if [ "${#disks[@]}" -gt 1 ]; then
    if [ ! -e "$MD" ]; then
      mdadm --assemble --scan >/dev/null 2>&1 || true
    fi
    if [ ! -e "$MD" ]; then
      mdadm --create "$MD" --run --level=0 --raid-devices="${#disks[@]}" --name=gts-scratch "${disks[@]}"
    fi
    target=$MD
  else
    target=${disks[0]}
  fi
  if ! blkid "$target" >/dev/null 2>&1; then
    mkfs.xfs -f -L "$LABEL" "$target"
  fi
  existing=$(blkid -L "$LABEL")
fi

uuid=$(blkid -s UUID -o value "$existing")
if ! grep -q "$uuid" "$FSTAB"; then
  echo "UUID=$uuid $MOUNT xfs defaults,noatime,nofail,x-systemd.device-timeout=30 0 2" >> "$FSTAB"
fi
mount "$MOUNT"
ready "$existing mounted at $MOUNT"
