"""A training worker stand-in for the spot-notice tests, run by the real entrypoint and torchrun
(TRAIN_MODULE=tests.stand_in_worker): it idles like a training step loop; SIGTERM "checkpoints"
for 2 s, writes `saved` to $GTS_TEST_MARKER and exits 0; SIGUSR1 appends `checkpoint now`.
Once its handlers are in place it creates $GTS_TEST_MARKER.ready: the event the tests wait on."""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> int:
    marker = os.environ["GTS_TEST_MARKER"]

    def stop(*_: object) -> None:
        time.sleep(2)
        with open(marker, "w", encoding="utf-8") as fh:
            fh.write("saved")
        sys.exit(0)

    def checkpoint(*_: object) -> None:
        with open(marker, "a", encoding="utf-8") as fh:
            fh.write("checkpoint now\n")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, checkpoint)
    open(marker + ".ready", "w", encoding="utf-8").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
