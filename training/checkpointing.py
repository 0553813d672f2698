"""Compatibility: the checkpoint library lives in training/ckpt/ (issue 45).
This path, the one user code was told to import before, is the module training/ckpt/checkpointer.py
itself: every name, and a patch of one, as before."""

import sys

from training.ckpt.checkpointer import (EXIT_PEER_STOPPED, Checkpointer, Interval, Resumed, Stateful, StopFlag,
                                        choose_checkpoint, exit_code, finish, open_manager, rng_state, set_rng_state)

__all__ = ["EXIT_PEER_STOPPED", "Checkpointer", "Interval", "Resumed", "Stateful", "StopFlag", "choose_checkpoint",
           "exit_code", "finish", "open_manager", "rng_state", "set_rng_state"]

sys.modules[__name__] = sys.modules["training.ckpt.checkpointer"]  # the names above are for readers and type checkers
