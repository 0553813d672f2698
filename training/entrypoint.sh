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
set -euo pipefail
# The contract's values first (training/contract.py): a bad one stops here, named, on one line.
python -m training.contract check
LAUNCHER=${LAUNCHER:-torchrun}
NNODES=${NNODES:-1}
MIN_NNODES=${MIN_NNODES:-$NNODES}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
NODE_RANK=${NODE_RANK:-0}
# What every process runs: your command (TRAIN_COMMAND, the stack's training.command, with ${NAME}
# expanded from the contract), else our trainer's module with this script's arguments.
TRAIN_MODULE=${TRAIN_MODULE:-training.train}
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
fi
if [ "${NPROC_PER_NODE}" -lt 1 ]; then NPROC_PER_NODE=1; fi

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
      # Rebuild the store's view every round: a joining node otherwise waits forever
      # (pytorch/pytorch#135712).
      export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
      # torchrun with the rendezvous state signed under the group's RDZV_KEY: the agents
      # unpickle it, and the store has no authentication (training/rdzv_launch.py).
      cmd=(python -m training.rdzv_launch --nnodes "$MIN_NNODES:$NNODES" --nproc-per-node "$NPROC_PER_NODE"
           --rdzv-backend gts-c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$id"
           --rdzv-conf "is_host=false,read_timeout=300,last_call_timeout=${RDZV_LAST_CALL_S:-30}" --max-restarts "${MAX_RESTARTS:-100}"
           --local-addr "$(local_address "${RDZV_ENDPOINT%:*}")" "${no_python[@]}" "${target[@]}" "$@")
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

workers() {
  cat /proc/"$LAUNCHED"/task/*/children 2>/dev/null || true
}

STOPPING=""
# shellcheck disable=SC2329  # called by the traps below
forward() {
  if [ "$1" != USR1 ]; then STOPPING=$1; fi
  # shellcheck disable=SC2046  # one pid per word
  kill -s "$([ "$1" = USR1 ] && echo USR1 || echo TERM)" $(workers) 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1

# The launcher in a session of its own: a terminal's Ctrl-C or a process-group signal reaches
# this script only, which passes it on to the workers.
setsid "${cmd[@]}" &
LAUNCHED=$!
echo "entrypoint: pid $$ (kill -TERM $$: checkpoint and stop; kill -USR1 $$: checkpoint now)" >&2
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
# After a stop the trainer's rank 0 has said where the run stopped; a real failure is non-zero.
exit "$status"
