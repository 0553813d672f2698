"""Talking to the peer stores (training/ckpt/peer/store.py): signed requests, signed answers."""

from __future__ import annotations

import http.client
import json
import logging
from typing import Any

from training.ckpt.peer import history, wire

log = logging.getLogger("gts.peer")


class PeerRefused(Exception):
    """A store answered other than expected, or unsigned (the message names the store and why)."""


class Link:
    """Requests to the stores of one run, signed with its key."""

    def __init__(self, key: bytes, timeout_s: float = 60.0):
        self.key = key
        self.timeout_s = timeout_s

    def _request(self, store: str, method: str, path: str, body: bytes | memoryview = b"",
                 payload_digest: str = "") -> tuple[int, bytes, Any]:
        host, _, port = store.rpartition(":")
        signed_as = wire.store_name(host, port)
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=self.timeout_s)
        try:
            conn.request(method, path, body=body if body else None,
                         headers=wire.headers(self.key, method, path, payload_digest, len(body), signed_as))
            answer = conn.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException) as exc:  # a store dying mid-answer: IncompleteRead
            raise PeerRefused(f"peer store {store}: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()
        why = wire.check(self.key, f"ANSWER {answer.status}", path, answer.headers, len(data), signed_as)
        named = str(answer.headers.get(wire.DIGEST, ""))
        if not why and named.startswith("sha256:") and named != wire.body_digest(data):
            why = "with a body that does not match its signed digest"
        elif not why and not named.startswith("sha256:") and not wire.COPY.match(path) and not (
                wire.PIECES.match(path) and named.startswith(wire.PIECES_NAMED)):  # checked_pieces checks those
            why = "with no signed digest of its body"
        if why:
            raise PeerRefused(f"peer store {store} answered {path} {why}")
        return answer.status, data, answer.headers

    def put(self, store: str, world: int, rank: int, step: int, kind: str, data: bytes | memoryview,
            payload_digest: str, generation: str = "0-0") -> None:
        status, body, _ = self._request(store, "PUT", f"/v1/copy/{world}/{rank}/{step}/{kind}/{generation}", data,
                                        payload_digest)
        if status != 200:
            raise PeerRefused(f"peer store {store} refused step {step} of rank {rank}: {status} {body[:200]!r}")

    def listing(self, store: str) -> list[list[Any]]:
        """[world, rank, step, kind, digest, size, generation] of every copy `store` holds."""
        return self.held(store)[0]

    def held(self, store: str) -> tuple[list[list[Any]], list[list[Any]]]:
        """(the copies `store` holds, as `listing`; the restores it recorded, history.valid_record)."""
        status, body, _ = self._request(store, "GET", wire.LIST)
        if status != 200:
            raise PeerRefused(f"peer store {store}: {status} {body[:200]!r}")
        answer = json.loads(body)
        if not isinstance(answer, dict) or not isinstance(answer.get("copies"), list) or not isinstance(
                answer.get("restores"), list) or not all(history.valid_record(r) for r in answer["restores"]) \
                or not all(wire.valid_entry(e) for e in answer["copies"]):
            raise PeerRefused(f"peer store {store} listed neither copies nor restores as this version does")
        return list(answer["copies"]), list(answer["restores"])

    def held_all(self, stores: list[str]) -> tuple[list[tuple[str, list[Any]]], list[list[Any]]]:
        """((store, copy) of every copy `stores` hold, every restore they recorded); a store that
        cannot be listed is logged and left out."""
        found, records = [], []
        for store in stores:
            try:
                copies, recorded = self.held(store)
            except (PeerRefused, ValueError) as exc:
                log.warning("peer store %s not listed: %s", store, exc)
                continue
            found += [(store, entry) for entry in copies]
            records += recorded
        return found, records

    def get(self, store: str, world: int, rank: int, step: int, kind: str, generation: str = "0-0"
            ) -> tuple[str, bytes]:
        """(the digest the sender named, the bytes)."""
        status, body, headers = self._request(store, "GET", f"/v1/copy/{world}/{rank}/{step}/{kind}/{generation}")
        if status != 200:
            raise PeerRefused(f"peer store {store} holds no {kind} copy of step {step} of rank {rank}/{world}")
        return str(headers.get(wire.DIGEST, "")), body

    def pieces(self, store: str, entry: list[Any], step: int, first: int, count: int) -> memoryview | None:
        """Pieces first .. first + count - 1 (wire.PIECE bytes each) of the copy `entry` (as the
        stores list it: world, rank, step, kind, digest, size, generation), checked against its
        listed digest (wire.checked_pieces); None when they do not match."""
        world, rank, _, kind, listed, size, gen = entry
        status, body, _ = self._request(store, "GET", f"/v1/pieces/{world}/{rank}/{step}/{kind}/{gen}/{first}/{count}")
        if status != 200:
            raise PeerRefused(f"peer store {store} holds no {kind} copy of step {step} of rank {rank}/{world} "
                              f"with pieces {first}..{first + count - 1}")
        return wire.checked_pieces(body, int(size), str(listed), first, count)

    def keep_only(self, store: str, world: int, step: int, generation: str = "", chosen: str = "") -> None:
        """The store forgets every copy but those of `step` saved by world size `world` (0: any);
        with `generation`, it records that restore (and `chosen`, the generation of the copy taken)."""
        tail = f"/{generation}/{chosen}" if generation else ""
        status, body, _ = self._request(store, "DELETE", f"/v1/keep/{world}/{step}{tail}")
        if status != 200:
            raise PeerRefused(f"peer store {store} did not forget: {status} {body[:200]!r}")
