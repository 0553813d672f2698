#!/usr/bin/env bash
# Container entrypoint (and `make train-local`): start the trainer with the launcher the stack
# chose (LAUNCHER) on this node's GPUs; with several nodes, one elastic torchrun job across them
# through the rendezvous store at RDZV_ENDPOINT.
#
# Stopping: SIGTERM or SIGINT to this script (docker stop, the pod's termination, the spot
# watcher, a person) goes to the training workers, not to their launcher: they finish the step,
# commit an emergency checkpoint and exit 0, and so does this script. torchrun itself would
# forward the signal, SIGKILL the workers 30 s later and exit 1. SIGUSR1: a checkpoint now.
# On a node of a multi-node run, the launcher is then killed outright, so that it neither waits
# in its exit barrier nor closes the rendezvous for the nodes that go on without this one.
#
# SIGKILL of this script takes the launcher and every worker with it (training/node/guard.py).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: training/node/entrypoint.sh [TRAINER OPTIONS]

Starts NPROC_PER_NODE training processes on this node (default: one per GPU that nvidia-smi
lists, else one) with LAUNCHER (torchrun | accelerate | horovod); with NNODES > 1 one elastic
job across the nodes through the rendezvous store at RDZV_ENDPOINT. Each process runs
TRAIN_COMMAND (the stack's training.command) when set, else python -m TRAIN_MODULE
(training.trainer.train) with the options given here. The trainer contract (training/contract.py,
docs/contract.md's table) names every variable.
Signals: TERM / INT: checkpoint and stop (exit 0); USR1: checkpoint now.
EOF
  if [ -n "${TRAIN_COMMAND:-}" ]; then
    echo; echo "TRAIN_COMMAND is set: the options are your command's own."
  else
    echo; python -m "${TRAIN_MODULE:-training.trainer.train}" --help
  fi
}
for arg in "$@"; do
  case "$arg" in -h|--help) usage; exit 0 ;; esac
done
# The contract's values first (training/contract.py): a bad one stops here, named, on one line.
python -m training.contract check
LAUNCHER=${LAUNCHER:-torchrun}
NNODES=${NNODES:-1}
MIN_NNODES=${MIN_NNODES:-$NNODES}
NODE_RANK=${NODE_RANK:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [ "${NPROC_PER_NODE:-0}" -lt 1 ]; then
    echo "entrypoint: no GPU listed by nvidia-smi: one training process (set NPROC_PER_NODE for more)" >&2
    NPROC_PER_NODE=1
  fi
fi
# What every process runs: your command (TRAIN_COMMAND, the stack's training.command, with ${NAME}
# expanded from the contract), else our trainer's module with this script's arguments.
TRAIN_MODULE=${TRAIN_MODULE:-training.trainer.train}
own_flags=()
no_python=()
if [ -n "${TRAIN_COMMAND:-}" ]; then
  mapfile -d '' -t target < <(python -m training.contract command)
  case "${target[0]}" in
    -m|*.py) ;;
    *) no_python=(--no-python) ;;  # an executable: the launchers run it as it is
  esac
else
  target=(-m "$TRAIN_MODULE")
  own_flags=(--launcher "$LAUNCHER")
  if [ "$TRAIN_MODULE" = training.trainer.train ]; then
    # Usage errors once, on one line, before any launcher starts (and its traceback per worker).
    python -m training.trainer.config "$@"
  fi
fi
# A refusal (the run's lock, changed settings, too little data) is written here by the trainer,
# which then exits 0 so that the launcher stays quiet; this script says it last and exits 2.
GTS_REFUSAL_FILE=$(mktemp "${TMPDIR:-/tmp}/gts-refusal.XXXXXX")
# A worker's fault, one line (training/trainer/train.py failed()): said last, below the launcher's
# report of the failed worker, which names no cause.
GTS_FAILURE_FILE=$(mktemp "${TMPDIR:-/tmp}/gts-failure.XXXXXX")
export GTS_REFUSAL_FILE GTS_FAILURE_FILE
# The run's records (training/records.py): this node's capacity request, boot and GPU gate (the
# gate's marker on scratch); the trainer adds its own. Heartbeats and stacks for the hang watchdog
# (training/node/watchdog.py) go to GTS_PROGRESS_DIR; NCCL's flight recorder dumps there too.
GTS_PROGRESS_DIR=${GTS_PROGRESS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gts-progress.XXXXXX")}
export GTS_PROGRESS_DIR GTS_GATE_MARKER=${GTS_GATE_MARKER:-${GTS_SCRATCH_DIR:-/scratch}/.gts-gate-passed}
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000} TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$GTS_PROGRESS_DIR/nccl_trace_rank_}
rm -f "$GTS_PROGRESS_DIR/stopping"
python -m training.records node-start || true
PEER_STORE=""
WATCHDOG=""
# shellcheck disable=SC2329  # called by the trap
on_exit() {
  rm -f "$GTS_REFUSAL_FILE" "$GTS_FAILURE_FILE"
  if [ -n "$PEER_STORE" ]; then kill "$PEER_STORE" 2>/dev/null || true; fi
  if [ -n "$WATCHDOG" ]; then kill "$WATCHDOG" 2>/dev/null || true; fi
}
trap on_exit EXIT

# The address this node reaches the store from: other nodes reach its workers there.
local_address() {
  python -c 'import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9))
print(s.getsockname()[0])' "$1"
}

case "$LAUNCHER" in
  torchrun)
    if [ "$NNODES" -gt 1 ]; then
      # The store runs apart from the nodes (is_host=false), so any node may go; a run's id
      # comes from its checkpoint URL and length, so a new run never meets a finished one.
      id=${RDZV_ID:-${GTS_NODE_GROUP:-gts}-$(printf '%s %s' "${CHECKPOINT_URL:-}" "${TRAIN_STEPS:-}" | sha256sum | cut -c1-12)}
      # How fast the survivors of a lost node form a world (docs/recovery.md; the defaults are
      # training/contract.py's RECOVERY_DEFAULTS): torch drops a node whose agent missed
      # keep_alive_max_attempt heartbeats keep_alive_interval apart (dynamic_rendezvous.py
      # _RendezvousStateHolder._sanitize), then completes the round last_call_timeout after
      # MIN_NNODES are in (_RendezvousJoinOp); with the peer tier, a member whose peer store
      # refuses connections goes at once (training/node/rdzv_liveness.py). The heartbeats'
      # stamps are compared across the nodes' clocks: 2 s x 5 leaves room for skew and a loaded
      # agent. A run with the peer tier takes a 3 s last call (fast shrinks); others torch's 30 s
      # (late cold-boot nodes join the first round instead of restarting the world when they arrive).
      last_call=30
      if [ "${PEER_EVERY:-0}" -gt 0 ]; then last_call=3; fi
      rdzv_conf="is_host=false,read_timeout=300,last_call_timeout=${RDZV_LAST_CALL_S:-$last_call}"
      rdzv_conf+=",keep_alive_interval=${RDZV_KEEPALIVE_S:-2},keep_alive_max_attempt=${RDZV_KEEPALIVE_MISSES:-5}"
      # The workers' store: hosted by the rank-0 node's agent on its private address, anew
      # every round (training/node/rdzv_launch.py PrivateWorkerStoreHandler).
      # torchrun with the rendezvous state signed under the group's RDZV_KEY: the agents
      # unpickle it, and the store has no authentication (training/node/rdzv_launch.py).
      addr=$(local_address "${RDZV_ENDPOINT%:*}")
      if [ "${PEER_EVERY:-0}" -gt 0 ]; then
        # The node's peer store (training/ckpt/peer/store.py): other nodes' newest states in host
        # memory, beside the agent (it outlives the workers), on this node's address alone.
        # The agent starts once the store listens (its --ready-file): a worker's first copy or
        # listing must not meet a port not yet open.
        ready=$(mktemp)
        python -m training.ckpt.peer.store --addr "$addr" --port "${PEER_PORT:-29600}" --ready-file "$ready" &
        PEER_STORE=$!
        for _ in $(seq 600); do
          [ -s "$ready" ] && break
          kill -0 "$PEER_STORE" 2>/dev/null || { echo "entrypoint: the peer store did not start (above)" >&2; exit 2; }
          sleep 0.05
        done
        rm -f "$ready"
        export GTS_PEER_STORE="$addr:${PEER_PORT:-29600}"
        # This node's zone for the buddies, asked of the metadata service once per node, not at
        # every worker start (training/ckpt/peer/ring.py node_zone; empty: none known). A zone is
        # optional: whatever goes wrong in asking leaves it empty, never stops the node.
        GTS_ZONE=${GTS_ZONE-$(python -m training.ckpt.peer.ring || true)}
        export GTS_ZONE
      fi
      cmd=(python -m training.node.rdzv_launch --nnodes "$MIN_NNODES:$NNODES" --nproc-per-node "$NPROC_PER_NODE"
           --rdzv-backend gts-c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$id"
           --rdzv-conf "$rdzv_conf" --max-restarts "${MAX_RESTARTS:-100}"
           --local-addr "$addr" "${no_python[@]}" "${target[@]}" "$@")
    else
      cmd=(torchrun --standalone --nproc-per-node "$NPROC_PER_NODE" "${no_python[@]}" "${target[@]}" "$@")
    fi
    ;;
  accelerate)
    machines=(--num_machines "$NNODES" --machine_rank "$NODE_RANK")
    if [ "$NNODES" -gt 1 ]; then
      machines+=(--main_process_ip "${RDZV_ENDPOINT%%:*}" --main_process_port "${RDZV_ENDPOINT##*:}")
    fi
    cmd=(accelerate launch --multi_gpu "${machines[@]}" --num_processes "$((NNODES * NPROC_PER_NODE))"
         --mixed_precision "${ACCELERATE_MIXED_PRECISION:-no}" --dynamo_backend no
         "${no_python[@]/--no-python/--no_python}" "${target[@]}" "${own_flags[@]}" "$@")
    ;;
  horovod)
    if [ ${#no_python[@]} -eq 0 ]; then target=(python "${target[@]}"); fi
    cmd=(horovodrun -np "$((NNODES * NPROC_PER_NODE))" "${target[@]}" "${own_flags[@]}" "$@")
    ;;
esac

children() {
  cat /proc/"$1"/task/*/children 2>/dev/null || true
}
# The launcher's children: the guard's grandchildren (or its adopted children once the launcher is gone),
# less the node's warm process (named gts-warm, training/node/warm.py): it forks the workers, it is not one.
workers() {
  local launcher pid
  for launcher in $(children "$LAUNCHED"); do
    for pid in $(children "$launcher"); do
      [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = gts-warm ] || echo "$pid"
    done
  done
}

STOPPING=""
# shellcheck disable=SC2329  # called by the traps below
forward() {
  if [ "$1" != USR1 ]; then
    STOPPING=$1
    : >"$GTS_PROGRESS_DIR/stopping"  # the hang watchdog stands down: the workers' emergency checkpoints
  fi
  # shellcheck disable=SC2046  # one pid per word
  kill -s "$([ "$1" = USR1 ] && echo USR1 || echo TERM)" $(workers) 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1
# USR2: the workers are killed and the launcher restarts them from the newest committed
# checkpoint (a GPU fault of the restart class, cloudinit/scripts/gts-gpu-health.py): only this
# script knows which processes are the workers (it runs the launcher under the guard).
# shellcheck disable=SC2046,SC2329  # one pid per word; called by the trap
restart_workers() { kill -KILL $(workers) 2>/dev/null || true; python -m training.records emit failure --failure xid || true; }
trap 'restart_workers' USR2

# The launcher under the guard, in a session of its own: a terminal's Ctrl-C or a process-group
# signal reaches this script only, which passes it on to the workers; and if this script is
# killed, the guard kills the launcher and the workers.
python -m training.node.guard "${cmd[@]}" &
LAUNCHED=$!
if [ "$LAUNCHER" = torchrun ] && [ "$NNODES" -gt 1 ]; then  # the launcher restarts what the watchdog stops
  python -m training.node.watchdog --parent $$ --launcher "$LAUNCHED" &
  WATCHDOG=$!
fi
echo "entrypoint: pid $$ (kill -TERM $$: checkpoint and stop; kill -USR1 $$: checkpoint now; kill -USR2 $$: restart the workers)" >&2
status=0
while true; do
  wait "$LAUNCHED" && status=0 || status=$?
  kill -0 "$LAUNCHED" 2>/dev/null || break  # a trap interrupted the wait: the launcher still runs
  if [ -n "$STOPPING" ] && [ "$NNODES" -gt 1 ] && [ "$LAUNCHER" = torchrun ]; then
    while [ -n "$(workers)" ]; do sleep 0.5; done
    kill -KILL "$LAUNCHED" 2>/dev/null || true
    wait "$LAUNCHED" 2>/dev/null || true
    status=0
    break
  fi
done
if [ -n "$WATCHDOG" ]; then  # its records and hang stacks reach the bucket before the node's run ends
  : >"$GTS_PROGRESS_DIR/stopping"
  wait "$WATCHDOG" 2>/dev/null || true
fi
if [ -s "$GTS_REFUSAL_FILE" ]; then
  echo "entrypoint: $(head -n 1 "$GTS_REFUSAL_FILE")" >&2
  exit 2
fi
if [ "$status" -ne 0 ] && [ -s "$GTS_FAILURE_FILE" ]; then
  # The last attempt's first fault: the file holds every restart's (training/trainer/failure.py).
  echo "entrypoint: the trainer failed (exit $status): $(python -m training.trainer.failure "$GTS_FAILURE_FILE") (the worker's traceback is above)" >&2
fi
# After a stop the trainer's rank 0 has said where the run stopped; a real failure is non-zero.
exit "$status"
