"""The trainer's resume helpers live in the library now (training/ckpt/restore.py): importable from here as before."""

from training.ckpt.restore import own_moments, restore_model

__all__ = ["own_moments", "restore_model"]
