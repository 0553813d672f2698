#!/usr/bin/env bash
# Scratch space at one fixed path: RAID0 over the local NVMe (or data) disks when there are
# several, XFS, mounted with nofail. Nothing destructive on a re-run or reboot: an existing
# array or filesystem labelled gts-scratch is reused as it is.
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"

MOUNT=${GTS_SCRATCH_DIR:-/scratch}
LABEL=gts-scratch
MD=/dev/md/gts-scratch
mkdir -p "$MOUNT"

if mountpoint -q "$MOUNT"; then
  echo "gts-nvme: $MOUNT already mounted"
  exit 0
fi

existing=$(blkid -L "$LABEL" 2>/dev/null || true)
if [ -z "$existing" ]; then
  mapfile -t disks < <(/usr/local/sbin/gts-disks.py)
  if [ "${#disks[@]}" -eq 0 ]; then
    echo "gts-nvme: no free NVMe or data disk; scratch stays on the root disk at $MOUNT"
    exit 0
  fi
  if [ "${#disks[@]}" -gt 1 ]; then
    if [ ! -e "$MD" ]; then
      mdadm --assemble --scan >/dev/null 2>&1 || true
    fi
    if [ ! -e "$MD" ]; then
      mdadm --create "$MD" --run --level=0 --raid-devices="${#disks[@]}" --name=gts-scratch "${disks[@]}"
      mdadm --detail --scan > /etc/mdadm.conf.gts
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
if ! grep -q "$uuid" /etc/fstab; then
  echo "UUID=$uuid $MOUNT xfs defaults,noatime,nofail,x-systemd.device-timeout=30 0 2" >> /etc/fstab
fi
mount "$MOUNT"
chmod 1777 "$MOUNT"
echo "gts-nvme: $existing mounted at $MOUNT"
