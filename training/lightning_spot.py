"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45). This path is the one
user code was told to import before; it re-exports training/ckpt/lightning.py unchanged."""

from training.ckpt.lightning import CKPT_FILE, SpotCheckpoint

__all__ = ["CKPT_FILE", "SpotCheckpoint"]
