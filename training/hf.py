"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45).
This path, the one user code was told to import before, is the module training/ckpt/hf.py
itself: every name, and a patch of one, as before."""

import sys

from training.ckpt.hf import SpotCheckpointCallback

__all__ = ["SpotCheckpointCallback"]

sys.modules[__name__] = sys.modules["training.ckpt.hf"]  # the names above are for readers and type checkers
