"""The rendezvous store of a multi-node run: a c10d TCPStore that the nodes' torchrun agents meet
at (`--rdzv-backend c10d --rdzv-conf is_host=false`). It runs apart from the training nodes — on
a small on-demand instance for VM fleets, as a Deployment on the system pool for Kubernetes
Jobs — so that losing any training node leaves the store, and the run, alive. It holds no
training state: restarting it costs the nodes one re-rendezvous.

    python -m training.rdzv_store --port 29400
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from torch._C

log = logging.getLogger("gts.rdzv")


def serve(port: int, host: str = "0.0.0.0", stop: threading.Event | None = None) -> None:
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30))
    log.info("rendezvous store listening on %s:%d", host, store.port)
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("rendezvous store stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.port, args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
