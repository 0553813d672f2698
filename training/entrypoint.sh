#!/usr/bin/env bash
# Container entrypoint: start the trainer with the launcher the stack chose (LAUNCHER), on
# this node's GPUs, joining the other nodes through RDZV_ENDPOINT when there are several.
set -euo pipefail
# The contract's values first (training/contract.py): a bad one stops here, named, on one line.
python -m training.contract check
LAUNCHER=${LAUNCHER:-torchrun}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
NODE_RANK=${NODE_RANK:-0}
# The Python module the launcher runs on every process (your own training code may replace it).
TRAIN_MODULE=${TRAIN_MODULE:-training.train}
if [ "${NPROC_PER_NODE}" -lt 1 ]; then NPROC_PER_NODE=1; fi

case "$LAUNCHER" in
  torchrun)
    if [ "$NNODES" -gt 1 ]; then  # RDZV_ENDPOINT is set: the contract check requires it
      exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d \
        --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${GTS_NODE_GROUP:-gts}" -m "$TRAIN_MODULE" "$@"
    fi
    exec torchrun --standalone --nproc-per-node "$NPROC_PER_NODE" -m "$TRAIN_MODULE" "$@"
    ;;
  accelerate)
    exec accelerate launch --multi_gpu --num_machines "$NNODES" --machine_rank "$NODE_RANK" \
      --num_processes "$((NNODES * NPROC_PER_NODE))" --main_process_ip "${RDZV_ENDPOINT%%:*}" \
      --main_process_port "${RDZV_ENDPOINT##*:}" -m "$TRAIN_MODULE" --launcher accelerate "$@"
    ;;
  horovod)
    exec horovodrun -np "$((NNODES * NPROC_PER_NODE))" python -m "$TRAIN_MODULE" --launcher horovod "$@"
    ;;
  *)
    echo "entrypoint: LAUNCHER must be torchrun, accelerate or horovod, not '$LAUNCHER'" >&2
    exit 2
    ;;
esac
