"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45).
This path, the one user code was told to import before, is the module training/ckpt/sharded.py
itself: every name, and a patch of one, as before."""

import sys

from training.ckpt.sharded import (ShardedCheckpoints, full_params_sha256, holds_dtensors, read_full_model, shard,
                                   state_sha256)

__all__ = ["ShardedCheckpoints", "full_params_sha256", "holds_dtensors", "read_full_model", "shard", "state_sha256"]

sys.modules[__name__] = sys.modules["training.ckpt.sharded"]  # the names above are for readers and type checkers
