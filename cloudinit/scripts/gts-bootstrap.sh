#!/usr/bin/env bash
# GPU node bootstrap, run by gts-bootstrap.service on every boot until it completes.
# Each step is idempotent and leaves a stamp, so a reboot (after a driver install) resumes
# where it stopped. Settings come from /etc/gpu-training/node.env.
set -euo pipefail

ENV_FILE=${GTS_ENV_FILE:-/etc/gpu-training/node.env}
STATE=${GTS_STATE_DIR:-/var/lib/gpu-training}
# shellcheck source=/dev/null
. "$ENV_FILE"
mkdir -p "$STATE"

log() { echo "gts-bootstrap: $*"; logger -t gts-bootstrap -- "$*" 2>/dev/null || true; }

step() {
  local name=$1; shift
  if [ -e "$STATE/$name.done" ]; then
    log "$name: already done"
    return 0
  fi
  log "$name: starting"
  "$@"
  touch "$STATE/$name.done"
  log "$name: done"
}

driver() {
  local rc=0
  /usr/local/sbin/gts-driver.sh || rc=$?
  if [ "$rc" -eq 100 ]; then
    # The driver needs a reboot; this service runs again on the next boot.
    touch "$STATE/driver.done"
    log "driver installed; rebooting"
    systemctl reboot
    exit 0
  fi
  return "$rc"
}

if [ "${GTS_MODE:-vm}" = "kubernetes" ]; then
  # EKS / ACK / TKE GPU images bring the driver and containerd; the cluster runs the trainer
  # (a Job) and the exporters (DaemonSets). The node adds scratch and the spot watcher.
  step scratch /usr/local/sbin/gts-nvme.sh
  systemctl daemon-reload
  systemctl enable --now gts-spot-watch.service
  log "node ready (kubernetes)"
  exit 0
fi

step driver driver
step runtime /usr/local/sbin/gts-runtime.sh
step scratch /usr/local/sbin/gts-nvme.sh
if [ -n "${GTS_DATASET_URL:-}" ]; then
  # Not stamped: the sync is resumable and cheap when the cache is complete.
  /usr/local/sbin/gts-dataset.sh
fi
systemctl daemon-reload
systemctl enable --now gts-exporters.service gts-spot-watch.service gts-trainer.service
log "node ready"
