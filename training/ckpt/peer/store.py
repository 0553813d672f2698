"""A node's peer store: host memory, beside the node's agent, that holds other nodes' newest
training states (training/ckpt/peer/tier.py sends them). It outlives the workers (torchrun restarts
those on a failure, and host memory a worker held dies with it) and dies with the node.

    RDZV_KEY=... python -m training.ckpt.peer.store --addr 10.0.1.12 --port 29600

Bound to the node's private address only (never the wildcard); every request and answer signed
with the run's key (training/ckpt/peer/wire.py); bounded: the newest KEEP steps per source (a rank of
one world size, each kind of copy), at most MAX_SOURCES sources and PEER_STORE_GIB (default half the node's memory). It checks no payload: the receiver hashes what it
gets against the digest the sender named, and refuses a copy that does not match. It records the
restores its world makes and lists them with its copies (training/ckpt/peer/history.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from training import contract
from training.cgroup import memory_limit
from training.ckpt.peer import history, wire

log = logging.getLogger("gts.peer.store")
KEEP = 2
MAX_SOURCES = 512
MAX_BYTES = 1 << 40  # one copy's most (a sanity bound on Content-Length, not a memory budget)
WILDCARDS = ("", "0.0.0.0", "::", "[::]")
TIMEOUT_S = 60.0  # a connection silent this long is closed
MAX_CONNECTIONS = 64  # open at once (a node's ranks send and fetch a few each)


class Copies:
    """(world, rank, kind) -> {step: (digest, bytes, generation)}, the newest KEEP steps of each source, at most
    `budget` bytes in all (a copy that would pass it is refused, never another one dropped for it). A
    node's local rank 0 sends both kinds (its full copy, and its own state alone for a restore that
    takes another full copy: training/ckpt/peer/tier.py)."""

    def __init__(self, budget: int = 1 << 62) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int, str], dict[int, tuple[str, bytes, str]]] = {}
        self._digests: dict[tuple[int, int, str, int, str, int], bytes] = {}  # piece_digests, per held copy
        self._restores: dict[str, tuple[int, str]] = {}  # generation -> (step restored, generation taken)
        self.budget = budget

    def put(self, world: int, rank: int, step: int, kind: str, payload_digest: str, data: bytes,
            generation: str = "0-0") -> bool:
        """Hold the copy (True), or refuse it (False) when the store would then pass its budget."""
        with self._lock:
            steps = dict(self._held.get((world, rank, kind), {}))
            steps[step] = (payload_digest, data, generation)
            kept = {s: steps[s] for s in sorted(steps)[-KEEP:]}
            others = sum(len(d) for source, held in self._held.items() if source != (world, rank, kind)
                         for _, d, _ in held.values())
            if others + sum(len(d) for _, d, _ in kept.values()) > self.budget:
                return False
            self._held[(world, rank, kind)] = kept
            while len(self._held) > MAX_SOURCES:  # the source with the oldest newest step goes
                del self._held[min(self._held, key=lambda s: max(self._held[s]))]
            return True

    def get(self, world: int, rank: int, step: int, kind: str, generation: str) -> tuple[str, bytes] | None:
        with self._lock:
            found = self._held.get((world, rank, kind), {}).get(step)
        return (found[0], found[1]) if found is not None and found[2] == generation else None

    def piece_digests(self, world: int, rank: int, step: int, kind: str, held: tuple[str, bytes]) -> bytes:
        """Every wire.PIECE-byte piece's digest of a held copy, joined: computed at its first
        /v1/pieces request (a PUT stays a copy into memory) and kept while the copy is."""
        key = (world, rank, kind, step, held[0], len(held[1]))
        with self._lock:
            found = self._digests.get(key)
        if found is None:
            found = b"".join(wire.piece_digests(held[1]))
            with self._lock:
                live = {(w, r, k, s, d[0], len(d[1])) for (w, r, k), steps in self._held.items() for s, d in steps.items()}
                self._digests = {k: v for k, v in self._digests.items() if k in live}
                if key in live:
                    self._digests[key] = found
        return found

    def keep_only(self, step: int, world: int | None = None, generation: str = "", chosen: str = "") -> int:
        """Drop every copy but those of `step` (and of world size `world`, when given): a world that
        restored `step` abandoned later steps, needs no older one, and never another world's. With
        `generation`: that restore recorded (the newest history.MAX_RECORDS), for `records`."""
        with self._lock:
            if generation:
                self._restores[generation] = (step, chosen)
                for old in sorted(self._restores, key=history.order)[:-history.MAX_RECORDS]:
                    del self._restores[old]
            dropped = 0
            for source in list(self._held):
                steps = self._held[source]
                gone = [s for s in steps if s != step or (world is not None and source[0] != world)]
                for s in gone:
                    del steps[s]
                dropped += len(gone)
                if not steps:  # no empty source is kept (eviction takes the newest step of each)
                    del self._held[source]
            return dropped

    def listing(self) -> list[list[Any]]:
        """[world, rank, step, kind, digest, size, generation] of every copy held."""
        with self._lock:
            return [[world, rank, step, kind, found, len(data), gen]
                    for (world, rank, kind), steps in sorted(self._held.items())
                    for step, (found, data, gen) in sorted(steps.items())]

    def records(self) -> list[list[Any]]:
        """[generation, step restored, generation taken or "durable"] of every restore recorded."""
        with self._lock:
            return [[gen, *self._restores[gen]] for gen in sorted(self._restores, key=history.order)]

    @property
    def size(self) -> int:
        with self._lock:
            return sum(len(d) for steps in self._held.values() for _, d, _ in steps.values())


def memory(proc: str = "/proc/self/cgroup") -> int:
    """The memory this process may use: the node's, or its cgroup's limit where that is less (a
    Job's pod: the store must not take half the host's memory inside a limit of less)."""
    node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(node, memory_limit(proc) or node)


def default_budget(env: dict[str, str] | None = None, proc: str = "/proc/self/cgroup") -> int:
    """PEER_STORE_GIB in bytes, else half the memory this process may use (`memory`)."""
    gib = contract.recovery(contract.PEER_STORE_GIB.name, env)
    return gib << 30 if gib else memory(proc) // 2


class Handler(BaseHTTPRequestHandler):
    server: PeerServer
    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT_S  # each socket read and write: a stalled client frees its thread

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug(format, *args)

    def _answer(self, code: int, body: bytes | list[bytes | memoryview], payload_digest: str = "") -> None:
        """A signed answer: its status, its store and its body's digest (a copy's: the digest its
        sender named, which the receiver checks the bytes against; else sha256 of the body). A
        body of parts (a copy's digests and pieces) is written part by part, never joined."""
        parts = body if isinstance(body, list) else [body]
        named = payload_digest if code == 200 and payload_digest else wire.body_digest(b"".join(parts))
        self.send_response(code)
        for name, value in wire.headers(self.server.key, f"ANSWER {code}", self.path, named,
                                        sum(len(p) for p in parts), self.server.name).items():
            self.send_header(name, value)
        self.end_headers()
        for part in parts:
            self.wfile.write(part)

    def _refused(self, size: int) -> bool:
        why = wire.check(self.server.key, self.command, self.path, self.headers, size, self.server.name)
        if why:
            log.warning("refused %s %s from %s: %s", self.command, self.path, self.client_address[0], why)
            self.close_connection = True
            self._answer(403, why.encode())
        return bool(why)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self._refused(0):
            return
        if self.path == wire.LIST:
            self._answer(200, json.dumps({"copies": self.server.copies.listing(),
                                          "restores": self.server.copies.records()}).encode())
            return
        part = wire.PIECES.match(self.path)
        if part:  # some pieces of a copy, after every piece's digest (Copies.piece_digests)
            world, rank, step, kind, gen, first, count = part.groups()
            held = self.server.copies.get(int(world), int(rank), int(step), kind, gen)
            if held is None or int(first) * wire.PIECE >= max(len(held[1]), 1):
                self._answer(404, b"no such copy, or no such piece of it")
                return
            digests = self.server.copies.piece_digests(int(world), int(rank), int(step), kind, held)
            at = int(first) * wire.PIECE
            self._answer(200, [digests, memoryview(held[1])[at:at + int(count) * wire.PIECE]],
                         wire.PIECES_NAMED + held[0])
            return
        match = wire.COPY.match(self.path)
        world, rank, step, kind, gen = match.groups() if match else ("0", "0", "0", "", "")
        found = self.server.copies.get(int(world), int(rank), int(step), kind, gen) if match else None
        if found is None:
            self._answer(404, b"no such copy")
            return
        if kind == "full":  # a restore: one per node and tried copy (training/ckpt/peer/tier.py), not one per rank
            log.info("sending the full copy of step %s of rank %s/%s to %s", step, rank, world, self.client_address[0])
        self._answer(200, found[1], found[0])

    def do_DELETE(self) -> None:  # noqa: N802
        if self._refused(0):
            return
        match = wire.KEEP_ONLY.match(self.path)
        if not match:
            self._answer(400, b"DELETE /v1/keep/<world or 0: any>/<step>[/<generation>/<generation taken or durable>]")
            return
        world, step = int(match.group(1)), int(match.group(2))
        dropped = self.server.copies.keep_only(step, world or None, match.group(3) or "", match.group(4) or "")
        if dropped:
            log.info("forgot %d copies (the run restored step %d)", dropped, step)
        self._answer(200, b"")

    def do_PUT(self) -> None:  # noqa: N802
        try:
            size = int(self.headers.get("Content-Length", ""))
        except ValueError:
            size = -1
        match = wire.COPY.match(self.path)
        if not match or not 0 <= size <= MAX_BYTES:
            self.close_connection = True
            self._answer(400, b"PUT /v1/copy/<world>/<rank>/<step>/<kind>/<generation> with a Content-Length")
            return
        if self._refused(size):
            return
        data = self.rfile.read(size)
        if len(data) != size:  # the sender died mid-send (or lied): nothing of it is kept
            self.close_connection = True
            self._answer(400, f"a body of {len(data)} bytes, {size} declared: not kept".encode())
            return
        world, rank, step, kind, gen = match.groups()
        if not self.server.copies.put(int(world), int(rank), int(step), kind, self.headers.get(wire.DIGEST, ""), data,
                                      gen):
            log.warning("refused step %s of rank %s/%s: %d bytes would pass the store's budget of %d (%s)", step,
                        rank, world, size, self.server.copies.budget, contract.PEER_STORE_GIB.name)
            self._answer(507, f"over the store's budget of {self.server.copies.budget} bytes "
                              f"({contract.PEER_STORE_GIB.name})".encode())
            return
        log.info("holding step %s of rank %s/%s (%.1f MiB; %.1f MiB held)", step, rank, world, size / 2**20,
                 self.server.copies.size / 2**20)
        self._answer(200, b"")


class PeerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: str, port: int, key: bytes, budget: int | None = None):
        if addr.strip() in WILDCARDS:
            raise ValueError(f"--addr {addr!r}: the node's private address, never the wildcard")
        self.key = key
        self.copies = Copies(budget if budget is not None else default_budget())
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((addr, port), Handler)
        self.name = wire.store_name(str(self.server_address[0]), self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        """At most MAX_CONNECTIONS at once; one more is closed at once (its sender says so)."""
        if not self._slots.acquire(blocking=False):
            log.warning("refused a connection from %s: %d open already", client_address[0], MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.ckpt.peer.store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", required=True, help="this node's private address (never 0.0.0.0)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-file", help="a file to write the store's address into once it listens")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s peer-store %(message)s")
    try:
        server = PeerServer(args.addr, args.port, wire.run_key())
    except (ValueError, OSError) as exc:
        print(f"peer store: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    if args.ready_file:
        with open(args.ready_file, "w", encoding="utf-8") as fh:
            fh.write(f"{server.name}\n")
    log.info("peer store listening on %s:%d", args.addr, server.server_address[1])
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
