"""The peer tier's wire, hardened (issue 46's review): a PUT whose body is shorter than declared
(a sender killed mid-send) stores nothing; answers are signed over their status, their body's
digest and the store's address, so a tampered answer, a changed status or an answer replayed
from another store is refused."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from tests.test_peer_store import KEY, _copy, _store
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link, PeerRefused


def test_a_put_cut_short_stores_nothing() -> None:
    with _store() as store:
        host, _, port = store.rpartition(":")
        data = _copy(10, 1.0)
        path = "/v1/copy/1/0/10/full/0-0"
        head = wire.headers(KEY, "PUT", path, wire.payload_digest(data), len(data), wire.store_name(host, port))
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall((f"PUT {path} HTTP/1.1\r\nHost: {store}\r\n" +
                          "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode() + data[:len(data) // 2])
            conn.shutdown(socket.SHUT_WR)  # the sender is gone, half of it sent
            answer = conn.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 400") and b"not kept" in answer
        assert Link(KEY).listing(store) == []


@contextmanager
def _forger(status: int, body: bytes, signed_body: bytes, signed_status: int, signed_store: str | None
            ) -> Iterator[str]:
    """A store stand-in that answers every GET with `body` and `status`, signed (with the run's
    key) over `signed_body`, `signed_status` and `signed_store` (None: its own address)."""
    class Forged(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            address: Any = self.server.server_address
            name = signed_store or wire.store_name(str(address[0]), str(address[1]))
            self.send_response(status)
            for key, value in wire.headers(KEY, f"ANSWER {signed_status}", self.path, wire.body_digest(signed_body),
                                           len(body), name).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass
    server = HTTPServer(("127.0.0.1", 0), Forged)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


EMPTY = b'{"copies": [], "restores": []}'
ODD = "listed neither copies nor restores as this version does"


@pytest.mark.parametrize("status,body,signed_body,signed_status,signed_store,why", [
    (200, b'{"copies": [[1,0,9,"full"]], "restores": []}', b'{"copies": [[1,0,5,"full"]], "restores": []}', 200,
     None, "does not match its signed digest"),
    (200, EMPTY, EMPTY, 404, None, "not signed with this run's key"),
    (200, EMPTY, EMPTY, 200, "10.0.0.9:29600", "not signed with this run's key"),
    # signed, but not what this version lists: an older store's bare list, records that are not restores
    (200, b"[]", b"[]", 200, None, ODD),
    (200, b'{"copies": [], "restores": [["1-0", -1, "durable"]]}',
     b'{"copies": [], "restores": [["1-0", -1, "durable"]]}', 200, None, ODD),
    (200, b'{"copies": [], "restores": [["1-0", 5, "rm -rf"]]}',
     b'{"copies": [], "restores": [["1-0", 5, "rm -rf"]]}', 200, None, ODD),
    (200, b'{"copies": [[1,0,5,"full"]], "restores": []}', b'{"copies": [[1,0,5,"full"]], "restores": []}', 200,
     None, ODD),  # a copy listed short
    (200, b'{"copies": [[1,0,"5","full","d",3,"1-0"]], "restores": []}',
     b'{"copies": [[1,0,"5","full","d",3,"1-0"]], "restores": []}', 200, None, ODD),  # a step that is no number
    (200, b'{"copies": [[1,0,5,"../x","d",3,"1-0"]], "restores": []}',
     b'{"copies": [[1,0,5,"../x","d",3,"1-0"]], "restores": []}', 200, None, ODD),  # a kind no path takes
])
def test_a_tampered_or_replayed_answer_is_refused(status: int, body: bytes, signed_body: bytes, signed_status: int,
                                                  signed_store: str | None, why: str) -> None:
    with _forger(status, body, signed_body, signed_status, signed_store) as store:
        with pytest.raises(PeerRefused, match=why):
            Link(KEY).listing(store)
    with _forger(200, EMPTY, EMPTY, 200, None) as store:
        assert Link(KEY).listing(store) == []  # the honest answer passes


def test_the_store_writes_its_ready_file_once_it_listens(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from tests.training_helpers import RDZV_TEST_KEY, ROOT, free_port

    ready, port = tmp_path / "ready", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "training.ckpt.peer.store", "--addr", "127.0.0.1", "--port", str(port),
                             "--ready-file", str(ready)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RDZV_KEY": RDZV_TEST_KEY, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # an event, not a sleep: the store's own listening line
            if "peer store listening" in line:
                break
        assert ready.read_text() == f"127.0.0.1:{port}\n"
        assert Link(KEY).listing(f"127.0.0.1:{port}") == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)
