"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45).
This path, the one user code was told to import before, is the module training/ckpt/manager.py
itself: every name, and a patch of one, as before."""

import sys

from training.ckpt.manager import (DOT_LEAF, FILE_NAME, MAX_DEPTH, MAX_NODES, MODEL_FILE, STEP_RE, CheckpointError,
                                   CheckpointManager, RunLocked, Topology, UploadStatus, check_manifest, inside,
                                   manifest_name, plain_path, rng_name, run_key, sha256_of, step_dir, tree_files)

__all__ = ["DOT_LEAF", "FILE_NAME", "MAX_DEPTH", "MAX_NODES", "MODEL_FILE", "STEP_RE", "CheckpointError",
           "CheckpointManager", "RunLocked", "Topology", "UploadStatus", "check_manifest", "inside", "manifest_name",
           "plain_path", "rng_name", "run_key", "sha256_of", "step_dir", "tree_files"]

sys.modules[__name__] = sys.modules["training.ckpt.manager"]  # the names above are for readers and type checkers
