#!/usr/bin/env bash
# GPU node bootstrap, run by gts-bootstrap.service on every boot until the node is ready.
# Each step is idempotent and stamped only once it has succeeded, so a failed step is retried
# (the unit restarts) and a driver install's reboot resumes where it stopped. The bootstrap then
# starts the node's services without waiting for them (--no-block): they are ordered after this
# unit, and a blocking start from here would wait for this unit to finish — forever.
set -euo pipefail

ENV_FILE=${GTS_ENV_FILE:-/etc/gpu-training/node.env}
STATE=${GTS_STATE_DIR:-/var/lib/gpu-training}
SBIN=${GTS_SBIN:-/usr/local/sbin}
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
  local started=$SECONDS
  log "$name: starting"
  "$@"  # a failure ends the bootstrap here, unstamped; the unit retries it
  touch "$STATE/$name.done"
  log "$name: done in $((SECONDS - started)) s"
}

start_services() {
  systemctl daemon-reload
  systemctl enable "$@"
  systemctl start --no-block "$@"
}

if [ "${GTS_MODE:-vm}" = "kubernetes" ]; then
  # EKS / ACK / TKE GPU images bring the driver and containerd; the cluster runs the trainer
  # (a Job) and the exporters (DaemonSets). The node adds scratch and the spot watcher.
  # Pods mount the shared file system themselves; its root is handed to the trainer's uid here.
  step shared "$SBIN/gts-shared.sh" --prepare
  touch "$STATE/ready"
  start_services gts-scratch.service gts-spot-watch.service
  log "node ready (kubernetes)"
  exit 0
fi

if [ "${GTS_MODE:-vm}" = "rendezvous" ]; then
  # The rendezvous store of the network's multi-node runs: Docker and the store, no GPU.
  step runtime "$SBIN/gts-runtime.sh"
  touch "$STATE/ready"
  start_services gts-rdzv.service
  log "rendezvous store started"
  exit 0
fi

step driver "$SBIN/gts-driver.sh"
if [ -e "$STATE/reboot-required" ]; then
  # The new kernel module loads after a reboot; this unit runs again then, driver stamped.
  rm -f "$STATE/reboot-required"
  log "driver installed; rebooting"
  systemctl reboot
  exit 0
fi
# The multi-node fabric's user space and host limits (gts-fabric.sh), where the group has one.
[ -z "${GTS_FABRIC:-}" ] || step fabric "$SBIN/gts-fabric.sh" install
step runtime "$SBIN/gts-runtime.sh"
touch "$STATE/ready"
start_services gts-scratch.service gts-shared.service gts-dataset.service gts-exporters.service \
  gts-spot-watch.service gts-trainer.service
log "node ready: scratch, shared file system, dataset cache, exporters, spot watcher and trainer started"
