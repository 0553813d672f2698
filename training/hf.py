"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45). This path is the one
user code was told to import before; it re-exports training/ckpt/hf.py unchanged."""

from training.ckpt.hf import SpotCheckpointCallback

__all__ = ["SpotCheckpointCallback"]
