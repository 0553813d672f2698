"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45). This path is the one
user code was told to import before; it re-exports training/ckpt/sharded.py unchanged."""

from training.ckpt.sharded import (ShardedCheckpoints, full_params_sha256, holds_dtensors, read_full_model, shard,
                                   state_sha256)

__all__ = ["ShardedCheckpoints", "full_params_sha256", "holds_dtensors", "read_full_model", "shard", "state_sha256"]
