"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45). This path is the one
user code was told to import before; it re-exports training/ckpt/checkpointer.py unchanged."""

from training.ckpt.checkpointer import (EXIT_PEER_STOPPED, Checkpointer, Interval, Resumed, Stateful, StopFlag,
                                        choose_checkpoint, exit_code, finish, open_manager, rng_state, set_rng_state)

__all__ = ["EXIT_PEER_STOPPED", "Checkpointer", "Interval", "Resumed", "Stateful", "StopFlag", "choose_checkpoint",
           "exit_code", "finish", "open_manager", "rng_state", "set_rng_state"]
