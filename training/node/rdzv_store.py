"""The rendezvous store of a multi-node run: a c10d TCPStore that the nodes' torchrun agents meet
at (`--rdzv-backend c10d --rdzv-conf is_host=false`). It runs apart from the training nodes — on
a small on-demand instance for VM fleets, as a Deployment on the system pool for Kubernetes
Jobs — so that losing any training node leaves the store, and the run, alive. It holds no
training state: restarting it costs the nodes one re-rendezvous.

    python -m training.node.rdzv_store --host 10.0.0.10 --port 29400

It listens on the one address it is given (the instance's private address; the pod's on
Kubernetes), not on every interface: TCPStore's own server binds the wildcard whatever host it
is given, so the store binds the socket itself and hands it over (`master_listen_fd`). The
store has no authentication; what the agents read from it is signed (training/node/rdzv_launch.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from torch._C

log = logging.getLogger("gts.rdzv")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` alone (IPv4 or IPv6 literal, or a name)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(socket.SOMAXCONN)
    return sock


def serve(port: int, host: str = "127.0.0.1", stop: threading.Event | None = None) -> None:
    sock = listen(host, port)
    store = TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                     timeout=timedelta(minutes=30), master_listen_fd=sock.fileno(), use_libuv=True)
    log.info("rendezvous store listening on %s:%d", host, store.port)
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("rendezvous store stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("--host", default="127.0.0.1",
                        help="the one address to listen on (the instance's or pod's private address)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.port, args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
