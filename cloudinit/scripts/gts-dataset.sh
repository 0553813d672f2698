#!/usr/bin/env bash
# Cache the dataset on scratch (then optionally in RAM) before the trainer starts. The copy runs
# in the training image (fsspec for s3://, oss://, cosn://, with the node's role credentials):
# many files in parallel, or the dataset's tar shards where it has them; resumable (finished
# files are skipped) and verified (sizes against the bucket listing). Its unit has no start
# timeout, so a dataset of a million files does not kill the bootstrap.
set -euo pipefail
ENV_FILE=${GTS_ENV_FILE:-/etc/gpu-training/node.env}
# shellcheck source=/dev/null
. "$ENV_FILE"

if [ -z "${DATASET_URL:-}" ]; then
  echo "gts-dataset: no dataset configured"
  exit 0
fi
SCRATCH=${GTS_SCRATCH_DIR:-/scratch}
DEST="$SCRATCH/datasets/current"
# The copy runs as the training image's uid (training/Dockerfile USER), as the dataset command:
# without --entrypoint the image's entrypoint (training/node/entrypoint.sh) would take it as the
# trainer's arguments and start training (joining the run's rendezvous) instead.
install -d -o "${GTS_TRAINER_UID:-1000}" -g "${GTS_TRAINER_UID:-1000}" -m 0755 "$DEST"
started=$SECONDS
python3 "${GTS_SBIN:-/usr/local/sbin}/gts-registry-login.py" --env "$ENV_FILE"
docker run --rm --network host -v "$SCRATCH:$SCRATCH" --env-file "$ENV_FILE" \
  --entrypoint python "$GTS_IMAGE" -m training.node.datasync "$DATASET_URL" "$DEST" --workers "${GTS_DATASET_WORKERS:-32}"
echo "gts-dataset: $DATASET_URL cached in $DEST in $((SECONDS - started)) s"

if [ "${GTS_TMPFS_GB:-0}" -gt 0 ]; then
  need=$(du -sb "$DEST" | cut -f1)
  if [ "$need" -gt $((GTS_TMPFS_GB * 1024 * 1024 * 1024)) ]; then
    echo "gts-dataset: dataset ($need bytes) is larger than the ${GTS_TMPFS_GB} GiB tmpfs; reading from $DEST"
    exit 0
  fi
  RAM=/mnt/dataset-ram
  mkdir -p "$RAM"
  if ! mountpoint -q "$RAM"; then
    mount -t tmpfs -o "size=${GTS_TMPFS_GB}G,mode=1777" tmpfs "$RAM"
  fi
  cp -a --no-clobber "$DEST/." "$RAM/"
  # The trainer unit mounts DATA_DIR into the container, so it reads the RAM copy.
  sed -i "s#^DATA_DIR=.*#DATA_DIR=$RAM#" "$ENV_FILE"
fi
