"""What a checkpoint costs the training loop in wall time, everything included (issue 34).

The loop-blocked time (the state copied into reused buffers) is only part of it: the background
writer then shares the cores, memory bandwidth and disk with the loop, and the steps that run
while it writes are slower. A checkpoint's wall cost is its blocked time plus, for every step
that ran while its write was in flight, that step's time beyond the usual step time (a moving
average of the steps that ran with no write in flight). It is final at the first step after the
write is done; `make bench` measures the same quantity by running a loop with and without
checkpoints.
"""

from __future__ import annotations


class WallCost:
    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.usual: float | None = None  # seconds per step with no write in flight
        self._blocked = 0.0
        self._extra = 0.0
        self._open = False

    def checkpoint(self, blocked: float) -> float | None:
        """A checkpoint was started and blocked the loop `blocked` seconds. Returns the previous
        checkpoint's wall cost if it was still open (its write overlapped this one's start)."""
        previous = self._close() if self._open else None
        self._blocked, self._extra, self._open = blocked, 0.0, True
        return previous

    def step(self, seconds: float, writing: bool) -> float | None:
        """One step took `seconds`; `writing`: a checkpoint write was in flight during it.
        Returns the open checkpoint's wall cost once its write is done, else None."""
        if writing and self._open:
            if self.usual is not None:
                self._extra += max(0.0, seconds - self.usual)
            return None
        self.usual = seconds if self.usual is None else (1 - self.smoothing) * self.usual + self.smoothing * seconds
        return self._close() if self._open else None

    def _close(self) -> float:
        self._open = False
        return self._blocked + self._extra
