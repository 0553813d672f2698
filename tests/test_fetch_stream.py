"""training/ckpt/fetch.py over s3fs's real transport (aiobotocore on aiohttp) against a small HTTP
server playing S3's GetObject: the body is taken chunk by chunk as aiohttp received it (never
joined into new memory by `StreamReader.read`), a connection closed mid-body is fetched again,
a chunked body is taken whole across its chunk ends, and more bytes than the manifest's are
refused."""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from training.ckpt.manager import CheckpointError

DATA = bytes(range(256)) * (3 * (1 << 20) // 256 + 7)  # 3 MiB and a bit: many chunks


class _S3:
    """GET /b/k answers as the next queued behaviour says (the last one repeats)."""

    def __init__(self) -> None:
        self.behaviours: list[str] = ["whole"]
        self.gets = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.gets += 1
                how = server.behaviours.pop(0) if len(server.behaviours) > 1 else server.behaviours[0]
                body = DATA + b"x" * 10 if how == "longer" else DATA
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if how in ("chunked", "tiny"):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    # "tiny": 3,000 one-byte HTTP chunks, then the rest in one; else sizes in turn
                    sizes = [1] * 3000 + [len(body)] if how == "tiny" else [1, 4096, 1, 1 << 20, 3, 65536] * 8
                    pos = 0
                    for size in sizes:
                        piece = body[pos:pos + size]
                        if piece:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        pos += len(piece)
                    assert pos == len(body)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if how == "half":
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)  # a connection reset mid-body
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_S3, Any]]:
    import aiohttp.streams
    import fsspec

    def joined(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("StreamReader.read joins the buffered chunks into new memory")

    monkeypatch.setattr(aiohttp.streams.StreamReader, "read", joined)
    server = _S3()
    fs = fsspec.filesystem("s3", anon=True, skip_instance_cache=True, client_kwargs={"endpoint_url": server.url},
                           config_kwargs={"s3": {"addressing_style": "path"}, "retries": {"max_attempts": 1}})
    try:
        yield server, fs
    finally:
        server.stop()


def _meta() -> dict[str, Any]:
    return {"size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest()}


@pytest.mark.parametrize("behaviour", ["whole", "chunked"])
def test_a_body_is_taken_chunk_by_chunk(tmp_path: Path, store: tuple[_S3, Any], behaviour: str) -> None:
    from training.ckpt.fetch import fetch_retrying

    server, fs = store
    server.behaviours = [behaviour]
    dest = tmp_path / "model.pt.part"
    fetch_retrying(fs, "b/k", dest, _meta(), CheckpointError, wait_max_s=0)
    assert dest.read_bytes() == DATA and server.gets == 1


def test_a_connection_closed_mid_body_is_fetched_again(tmp_path: Path, store: tuple[_S3, Any]) -> None:
    from training.ckpt.fetch import fetch_retrying

    server, fs = store
    server.behaviours = ["half", "half", "whole"]
    dest = tmp_path / "model.pt.part"
    fetch_retrying(fs, "b/k", dest, _meta(), CheckpointError, wait_max_s=0)
    assert dest.read_bytes() == DATA and server.gets == 3

    server.behaviours, server.gets = ["half"], 0  # never whole: the fault is raised, nothing is left
    with pytest.raises(Exception) as raised:
        fetch_retrying(fs, "b/k", dest, _meta(), CheckpointError, attempts=2, wait_max_s=0)
    assert not isinstance(raised.value, CheckpointError)  # the connection's fault, not the bytes'
    assert server.gets == 2 and not dest.exists()


def test_more_bytes_than_the_manifest_lists_are_refused_at_once(tmp_path: Path, store: tuple[_S3, Any]) -> None:
    from training.ckpt.fetch import fetch_retrying

    server, fs = store
    server.behaviours = ["longer"]
    dest = tmp_path / "model.pt.part"
    with pytest.raises(CheckpointError, match="more than the"):
        fetch_retrying(fs, "b/k", dest, _meta(), CheckpointError, wait_max_s=0)
    assert server.gets == 1 and not dest.exists()


def _body(content: Any) -> Any:
    from aiobotocore.response import AioStreamingBody

    return AioStreamingBody(type("Raw", (), {"content": content})(), None)


def _drain(next_bytes: Any) -> list[bytes]:
    import asyncio

    async def drain() -> list[bytes]:
        got = []
        while chunk := await next_bytes():
            got.append(chunk)
        return got
    # A loop of its own, never the thread's: asyncio.run leaves the main thread with no current
    # loop, and the Pulumi mock engine's tests after this one in the process ask for it.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(drain())
    finally:
        loop.close()


def test_an_http_chunk_end_is_not_the_end_of_the_body() -> None:
    """aiohttp's readchunk returns (b"", True) where an HTTP chunk ended after its bytes were
    already taken (the chunk's last bytes and its CRLF in different reads: timing the server
    above cannot force), and (b"", False) at the body's end."""
    from training.ckpt.fetch import _next_bytes

    script = [(b"ab", False), (b"", True), (b"", True), (b"cd", True), (b"", False)]

    class Content:
        async def readchunk(self) -> tuple[bytes, bool]:
            return script.pop(0)

        def at_eof(self) -> bool:
            return False

    assert _drain(_next_bytes(_body(Content()))) == [b"ab", b"cd"] and not script
    import asyncio
    import warnings

    with warnings.catch_warnings():  # the main thread still has a loop to give, as the mock engine's tests ask
        warnings.simplefilter("ignore", DeprecationWarning)
        assert asyncio.get_event_loop_policy().get_event_loop() is not None


def test_aiohttps_shared_empty_body_ends_every_time() -> None:
    """aiohttp gives a bodiless answer (Content-Length: 0 under its Python parser) one shared
    empty reader, whose readchunk says (b"", False) once per process and (b"", True) after:
    every empty body still ends, none spins."""
    from aiohttp.streams import EMPTY_PAYLOAD

    from training.ckpt.fetch import _next_bytes

    calls = []

    class Counting:
        async def readchunk(self) -> tuple[bytes, bool]:
            calls.append(1)
            assert len(calls) < 100, "readchunk called without end"
            return await EMPTY_PAYLOAD.readchunk()

        def at_eof(self) -> bool:
            return EMPTY_PAYLOAD.at_eof()

    for _ in range(3):
        assert _drain(_next_bytes(_body(Counting()))) == []
    assert len(calls) == 3


def test_another_transports_body_is_read_in_pieces() -> None:
    from training.ckpt.fetch import PIECE, _next_bytes

    asked: list[int] = []

    class Body:  # not aiobotocore's aiohttp body (its httpx one, a test double)
        raw_stream = property(lambda self: (_ for _ in ()).throw(RuntimeError("not read")))

        def __init__(self) -> None:
            self.left = [b"xy", b""]

        async def read(self, n: int) -> bytes:
            asked.append(n)
            return self.left.pop(0)

    assert _drain(_next_bytes(Body())) == [b"xy"] and asked == [PIECE, PIECE]


def test_a_body_of_tiny_chunks_is_held_as_few_objects(tmp_path: Path, store: tuple[_S3, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from training.ckpt import fetch

    server, fs = store
    server.behaviours = ["tiny"]
    most: list[int] = []
    put = fetch._Sink.put

    def counted(self: Any, chunks: list[bytes]) -> Any:
        most.append(len(chunks))
        return put(self, chunks)

    monkeypatch.setattr(fetch._Sink, "put", counted)
    dest = tmp_path / "model.pt.part"
    fetch.fetch_retrying(fs, "b/k", dest, _meta(), CheckpointError, wait_max_s=0)
    assert dest.read_bytes() == DATA and most and max(most) <= fetch.MAX_CHUNKS
