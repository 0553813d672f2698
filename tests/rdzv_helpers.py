"""Sockets and a store for the rendezvous tests (test_rdzv_liveness.py, test_rdzv_last_call.py):
a TCPStore server on loopback, a port something listens on, and one that refuses connections."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]


def tcp_store(timeout_s: int = 30) -> TCPStore:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


@contextlib.contextmanager
def listening_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def refused_port() -> int:
    with socket.socket() as s:  # bound, never listening, then closed: connecting is refused
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
