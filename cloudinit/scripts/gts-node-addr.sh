#!/usr/bin/env bash
# The node's private IPv4 address, where its exporters and the trainer's metrics listen: the
# source of its default route, else its first global address. Exit 1 when it has none, so that
# nothing falls back to listening on every interface (gts-exporters.service, gts-trainer.service).
set -euo pipefail
addr=$(ip -4 -o route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' || true)
if [ -z "$addr" ]; then
  addr=$(ip -4 -o addr show scope global 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}' || true)
fi
if ! [[ $addr =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "gts-node-addr: this node has no private IPv4 address to listen on" >&2
  exit 1
fi
echo "$addr"
