"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45).
This path, the one user code was told to import before, is the module training/ckpt/lightning.py
itself: every name, and a patch of one, as before."""

import sys

from training.ckpt.lightning import CKPT_FILE, SpotCheckpoint

__all__ = ["CKPT_FILE", "SpotCheckpoint"]

sys.modules[__name__] = sys.modules["training.ckpt.lightning"]  # the names above are for readers and type checkers
