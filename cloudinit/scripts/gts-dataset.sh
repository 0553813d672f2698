#!/usr/bin/env bash
# Cache the dataset on scratch, then optionally in RAM (tmpfs) for the data loader.
# The copy runs in the training image (fsspec for s3://, oss://, cosn://), is resumable
# (finished files are skipped) and verified (sizes against the bucket listing).
set -euo pipefail
# shellcheck source=/dev/null
. "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"

SCRATCH=${GTS_SCRATCH_DIR:-/scratch}
DEST="$SCRATCH/datasets/current"
mkdir -p "$DEST"
docker run --rm --network host -v "$SCRATCH:$SCRATCH" --env-file "${GTS_ENV_FILE:-/etc/gpu-training/node.env}" \
  "$GTS_IMAGE" python -m training.datasync "$GTS_DATASET_URL" "$DEST"

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
  sed -i "s#^DATA_DIR=.*#DATA_DIR=$RAM#" "${GTS_ENV_FILE:-/etc/gpu-training/node.env}"
fi
