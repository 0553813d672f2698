"""The trainer's resume helpers live in the library now (training/restore.py): importable from here as before."""

from training.restore import own_moments, restore_model

__all__ = ["own_moments", "restore_model"]
