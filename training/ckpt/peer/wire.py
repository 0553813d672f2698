"""What the peer stores and their clients say to each other: requests and answers signed with
an HMAC-SHA256 under the run's key (RDZV_KEY, as training/node/rdzv_launch.py signs the
rendezvous state), payloads named by the digest the manifests use (training/ckpt/digest.py)."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from typing import Any

from training.ckpt import digest

MAC = "X-Gts-Mac"
STAMP = "X-Gts-Time"
DIGEST = "X-Gts-Digest"
MAX_SKEW_S = 120  # a signed request older (or newer) than this is refused: no replay of an old one
# /v1/copy/<world size>/<rank>/<step>/<kind>/<generation>: one source's copy of one step (source = (world, rank));
# kind `full`: the replicated training state and the rank's own (a node's local rank 0), `rank`:
# the rank's own alone (RNG streams, data position).
# <generation>: <n>-<step>: the sending world restored <step>; <n> orders it after every generation its
# stores had seen (training/ckpt/peer/history.py), so that copies of two histories that reached one
# step are told apart, and a history a later restore left is never offered.
# Sharded state (training/ckpt/peer/sharded.py): `shard` (the rank's DCP file), `meta` (DCP's
# metadata, rank 0), `train` (the train state beside the shards, rank 0), `rng` (the rank's streams).
COPY = re.compile(r"^/v1/copy/(\d{1,6})/(\d{1,6})/(\d{1,12})/(full|rank|shard|meta|train|rng)/(\d{1,12}-\d{1,12})$")
# /v1/pieces/<world>/<rank>/<step>/<kind>/<generation>/<first>/<count>: part of a copy, for a reader that
# needs only some of its bytes (a sharded restore: training/ckpt/peer/shardset.py). The answer: the
# digests of every digest.PIECE-byte piece of the copy (32 bytes each, as the manifests' digest
# combines them), then the bytes of pieces first .. first + count - 1; the reader checks the digests
# against the copy's listed digest and each piece against its own.
PIECES = re.compile(r"^/v1/pieces/(\d{1,6})/(\d{1,6})/(\d{1,12})/(shard|meta|train|rng)/(\d{1,12}-\d{1,12})/"
                    r"(\d{1,9})/(\d{1,9})$")
PIECE = digest.PIECE
PIECES_NAMED = "pieces:"  # a /v1/pieces answer is named by its copy's digest, which checked_pieces checks it against
# /v1/keep/<world>/<step>[/<generation>/<chosen>]: forget every copy but those of <step> saved by world
# size <world> (0: any); a world that restored <step> abandoned later steps and needs no older one.
# With a generation: the store also records that restore (the new world's generation, and the
# generation of the peer copy it took, or `durable`), which it lists: training/ckpt/peer/history.py
KEEP_ONLY = re.compile(r"^/v1/keep/(\d{1,6})/(\d{1,12})(?:/(\d{1,12}-\d{1,12})/(\d{1,12}-\d{1,12}|durable))?$")
LIST = "/v1/list"


def valid_entry(entry: Any) -> bool:
    """[world, rank, step, kind, digest, size, generation] as a store lists a copy: whole numbers
    where numbers go, and a path to it that COPY takes."""
    return (isinstance(entry, list) and len(entry) == 7 and isinstance(entry[4], str)
            and all(isinstance(entry[i], int) and not isinstance(entry[i], bool) and entry[i] >= 0 for i in (0, 1, 2, 5))
            and COPY.match(f"/v1/copy/{entry[0]}/{entry[1]}/{entry[2]}/{entry[3]}/{entry[6]}") is not None)
KEY_VAR = "RDZV_KEY"  # the run's key (training/node/rdzv_launch.py signs the rendezvous with it)
ADDR_VAR = "GTS_PEER_STORE"  # host:port of this node's store (training/node/entrypoint.sh exports it)
MIN_KEY_CHARS = 32


def run_key() -> bytes:
    """The run's key from the environment, or SystemExit naming the variable."""
    value = os.environ.get(KEY_VAR, "")
    if len(value) < MIN_KEY_CHARS:
        raise SystemExit(f"peer store: {KEY_VAR} must hold the run's key (at least {MIN_KEY_CHARS} characters)")
    return value.encode()


def sign(key: bytes, method: str, path: str, stamp: str, payload_digest: str, size: int, store: str) -> str:
    """The MAC over a request (or an answer: method `ANSWER <status>`) to or from `store`
    (host:port): a request or answer replayed to or from another store does not match."""
    message = "\n".join((method, path, stamp, payload_digest, str(size), store)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def store_name(host: str, port: int | str) -> str:
    """The store's address as both sides sign it."""
    return f"{host.strip('[]')}:{port}"


def body_digest(body: bytes) -> str:
    """An answer's digest when it is no copy (a listing, a refusal): sha256 of its bytes."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


def headers(key: bytes, method: str, path: str, payload_digest: str = "", size: int = 0, store: str = ""
            ) -> dict[str, str]:
    stamp = f"{time.time():.6f}"
    return {STAMP: stamp, DIGEST: payload_digest, MAC: sign(key, method, path, stamp, payload_digest, size, store),
            "Content-Length": str(size)}


def check(key: bytes, method: str, path: str, got: Any, size: int, store: str = "") -> str:
    """"" when `got` (the headers) carry this run's signature over this request, fresh; else why not."""
    stamp, payload_digest, mac = got.get(STAMP, ""), got.get(DIGEST, ""), got.get(MAC, "")
    try:
        age = abs(time.time() - float(stamp))
    except ValueError:
        return "no time stamp"
    if age > MAX_SKEW_S:
        return f"signed {age:.0f} s away from now"
    if not hmac.compare_digest(sign(key, method, path, stamp, payload_digest, size, store), str(mac)):
        return "not signed with this run's key (RDZV_KEY)"
    return ""


def payload_hasher() -> digest.StreamHasher:
    """A hasher of the manifests' digest (blake3 of 8 MiB pieces), fed in order."""
    return digest.StreamHasher(digest.PIECES)


def payload_digest(data: bytes | memoryview) -> str:
    """The digest the manifests use for a file, of bytes in memory."""
    hasher = payload_hasher()
    hasher.update(data)
    return hasher.hexdigest()


def piece_digests(data: bytes | memoryview) -> list[bytes]:
    """The digest of each PIECE-byte piece of `data` (what payload_digest combines)."""
    view = memoryview(data)
    return [digest.piece_digest(view[at:at + PIECE]) for at in range(0, len(view), PIECE)]


def checked_pieces(body: bytes, size: int, listed: str, first: int, count: int) -> memoryview | None:
    """The bytes of pieces first .. first + count - 1 of a copy of `size` bytes listed with digest
    `listed`, from a /v1/pieces answer, when the piece digests combine to `listed` and each piece
    matches its own; else None."""
    total = -(-size // PIECE)
    head = 32 * total
    if len(body) < head or not 0 <= first <= first + count <= total:  # before anything sized by the listing
        return None
    digests = [body[at:at + 32] for at in range(0, head, 32)]
    if digest.combine(digests) != listed:
        return None
    data = memoryview(body)[head:]  # the pieces, not copied
    want = min(size, (first + count) * PIECE) - first * PIECE
    if len(data) != want or any(digest.piece_digest(data[k * PIECE:(k + 1) * PIECE]) != digests[first + k]
                                for k in range(count)):
        return None
    return data
