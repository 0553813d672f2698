"""One run per checkpoint prefix: a lease object in the bucket (`<prefix>/run.lease`).

The local lock (training/ckpt/manager.py's `_lock`) covers one node's folder only; two runs on
two machines (or two folders) that share a checkpoint URL would both write its steps. Global
rank 0 therefore takes a lease in the bucket before anything is written, renews it while the
run lives, and gives it back when the run ends. A second run finds it and is refused, naming
the holder; the lease is taken over only when it expired (its holder died without giving it
back) or when the holder is the same run (`run_identity`: an elastic restart, a replacement
node).

Taking it is a conditional write, so that two runs starting at once cannot both win:

- S3: PutObject with `If-None-Match: *` to create it, `If-Match: <etag>` to renew or take over
  an expired one (412 PreconditionFailed when another writer came first). AWS S3 conditional
  writes: https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html ;
  moto 5.2.5 honours both (tests/test_bucket_guard.py runs against it).
- OSS: `x-oss-forbid-overwrite: true` on PutObject (409 FileAlreadyExists): Alibaba Cloud,
  "Disable overwriting an object with the same name"
  (https://www.alibabacloud.com/help/en/object-storage-service/latest/disable-overwriting-object-with-the-same-name).
- COS: `x-cos-forbid-overwrite: true` on PUT Object (409 FileAlreadyExists): Tencent Cloud COS
  API, PUT Object (https://www.tencentcloud.com/document/product/436/7749).
  Both forbid-overwrite headers are ignored on a bucket that has (ever) had versioning on, and
  neither store offers an If-Match on writes: a renewal or a takeover there reads the lease,
  checks its ETag and writes (a read-then-write window of one request); the holder reads the
  lease back at every renewal, so a run that lost it learns so within one renewal interval.
  Not tried against OSS or COS themselves here (no account); S3 and file:// are tested.
- file:// (a shared file system): O_CREAT | O_EXCL to create; replace under an flock.
"""

from __future__ import annotations

import contextvars
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from training.ckpt.files import RunLocked
from training.ckpt.storage import Location, store_answer

log = logging.getLogger("gts.checkpoint")

LEASE_NAME = "run.lease"
TTL_S = 120.0  # a lease not renewed for this long is expired (GTS_LEASE_TTL_S)
CONFLICT = frozenset({"PreconditionFailed", "FileAlreadyExists", "ConditionalRequestConflict", "412", "409"})
_FORBID_OVERWRITE: contextvars.ContextVar[str] = contextvars.ContextVar("forbid_overwrite", default="")


class LeaseHeld(RunLocked):
    """Another run holds the checkpoint prefix (the message names it)."""


class Conflict(Exception):
    """A conditional write lost: the lease is not what the caller last read."""


def run_identity(env: Mapping[str, str], pid: int | None = None) -> str:
    """What makes two processes "the same run": GTS_RUN_ID when set (yours to give); else the
    stack's node group (GTS_NODE_GROUP: every node of a group, its replacements and its Job's
    pods run one run on the group's checkpoint URL); else torchrun's run id (TORCHELASTIC_RUN_ID:
    the same for every node and every restart of one launch); else this process (`pid`: the
    training process a fetch process asks for)."""
    for name, kind in (("GTS_RUN_ID", "run"), ("GTS_NODE_GROUP", "node group"), ("TORCHELASTIC_RUN_ID", "torchrun run")):
        value = env.get(name, "")
        if value and value != "none":
            return f"{kind} {value}"
    return f"process {os.getpid() if pid is None else pid} on {socket.gethostname()}"


class _Store:
    """The lease object's reads and conditional writes on one Location."""

    def __init__(self, remote: Location):
        self.remote = remote
        self.path = remote.join(LEASE_NAME)
        self.scheme = remote.url.split("://", 1)[0] if "://" in remote.url else "file"
        if remote.remote:
            bucket, _, self.key = self.path.partition("/")
            self.bucket = bucket
            self.header = {"oss": "x-oss-forbid-overwrite", "cosn": "x-cos-forbid-overwrite"}.get(self.scheme, "")

    # -- object stores ----------------------------------------------------------------------
    def _call(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        async def call() -> Any:
            token = _FORBID_OVERWRITE.set(kwargs.pop("_forbid", ""))
            try:
                await self.remote.fs.set_session()
                s3 = await self.remote.fs.get_s3(self.bucket)
                if self.header and not getattr(s3, "_gts_forbid", False):
                    s3.meta.events.register("before-sign.s3.PutObject", _add_forbid_header)
                    s3._gts_forbid = True
                return await getattr(s3, method)(Bucket=self.bucket, Key=self.key, **kwargs)
            finally:
                _FORBID_OVERWRITE.reset(token)

        try:
            return sync(self.remote.fs.loop, call)
        except Exception as exc:
            answer = store_answer(exc)
            if answer is not None and (answer[0] in CONFLICT or answer[0] in ("NoSuchKey", "404")):
                raise Conflict(answer[0]) from None
            raise

    def read(self) -> tuple[dict[str, Any], str] | None:
        if not self.remote.remote:
            try:
                raw = open(self.path, "rb").read()
            except FileNotFoundError:
                return None
            return json.loads(raw), hashlib.sha256(raw).hexdigest()
        try:
            answer = self._call("get_object")
        except Conflict:
            return None
        from fsspec.asyn import sync

        raw = sync(self.remote.fs.loop, answer["Body"].read)
        return json.loads(raw), str(answer["ETag"])

    def create(self, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        if not self.remote.remote:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise Conflict("exists") from None
            with os.fdopen(fd, "wb") as fh:
                fh.write(raw)
            return
        if self.header:
            self._call("put_object", Body=raw, _forbid=self.header)
        else:
            self._call("put_object", Body=raw, IfNoneMatch="*")

    def replace(self, body: dict[str, Any], etag: str) -> None:
        """Write `body` over the lease whose ETag the caller read as `etag` (Conflict if it changed)."""
        raw = json.dumps(body).encode()
        if not self.remote.remote:
            with open(self.path + ".mutex", "a") as mutex:
                fcntl.flock(mutex, fcntl.LOCK_EX)
                current = self.read()
                if current is None or current[1] != etag:
                    raise Conflict("changed")
                with open(self.path + ".part", "wb") as fh:
                    fh.write(raw)
                os.replace(self.path + ".part", self.path)
            return
        if self.header:  # OSS / COS: no If-Match on writes (see the module docstring)
            current = self.read()
            if current is None or current[1] != etag:
                raise Conflict("changed")
            self._call("put_object", Body=raw)
        else:
            self._call("put_object", Body=raw, IfMatch=etag)

    def delete(self) -> None:
        if not self.remote.remote:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        self._call("delete_object")


def _add_forbid_header(request: Any, **kwargs: Any) -> None:
    """botocore hook: the OSS / COS forbid-overwrite header on the lease's create only."""
    header = _FORBID_OVERWRITE.get()
    if header:
        request.headers[header] = "true"


class Lease:
    """The run's lease on `remote` (see the module docstring). `clock` is injectable for tests."""

    def __init__(self, remote: Location, run: str, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.time, pid: int | None = None):
        self.store = _Store(remote)
        self.url = remote.url
        self.run = run
        self.ttl = ttl_s if ttl_s is not None else float(os.environ.get("GTS_LEASE_TTL_S", "") or TTL_S)
        self.clock = clock
        # `pid`: the training process a fetch process takes the lease for (fetch_process.py).
        self.holder = f"{run} (pid {os.getpid() if pid is None else pid} on {socket.gethostname()})"
        self.token = secrets.token_hex(8)  # this taking's own: a release never deletes another one's lease
        self.expires = 0.0  # as last written
        self.shared = False  # taken over from another live process of the same run (`acquire`)
        self.held = False  # taken (False also while the store could not be reached yet)
        self.lost = ""  # why this run no longer holds the lease ("" while it does)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> dict[str, Any]:
        now = self.clock()
        self.expires = now + self.ttl
        return {"run": self.run, "holder": self.holder, "renewed": now, "expires": self.expires, "token": self.token}

    def describe(self, body: dict[str, Any]) -> str:
        left = float(body.get("expires", 0)) - self.clock()
        return (f"{body.get('holder', 'an unknown run')}, its lease renewed "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(body.get('renewed', 0))))} and good for "
                f"{max(left, 0):.0f} s more")

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld naming the run that holds it."""
        for _ in range(3):  # a conditional write lost to another taker: look again
            current = self.store.read()
            try:
                if current is None:
                    self.store.create(self._body())
                    self.held = True
                    return
                body, etag = current
                if body.get("run") == self.run or float(body.get("expires", 0)) <= self.clock():
                    # Another live process of this run held it (a replacement, a second start): a give-back
                    # of this taking must leave it to that one (fetch_process.py `_give_back`).
                    self.shared = body.get("holder") != self.holder and float(body.get("expires", 0)) > self.clock()
                    if body.get("run") != self.run:
                        log.warning("taking over the expired lease of %s on %s", body.get("holder"), self.url)
                    self.store.replace(self._body(), etag)
                    self.held = True
                    return
            except Conflict:
                continue
            raise LeaseHeld(f"{self.url} is in use by {self.describe(body)}: another run writes this checkpoint "
                            "prefix. Stop it, give this run another checkpoint URL, or (the same run restarted "
                            "elsewhere) give both the same GTS_RUN_ID")
        raise LeaseHeld(f"{self.url}: the run lease changed hands three times while this run tried to take it; "
                        "another run is starting on this checkpoint prefix")

    def renew(self) -> bool:
        """Extend the lease; False (and `lost` says why) when another run took it meanwhile."""
        if self.lost:
            return False
        if not self.held:  # the store was out of reach when the run started: take it now
            try:
                self.acquire()
                return True
            except LeaseHeld as exc:
                self.lost = str(exc)
                return False
        current = self.store.read()
        try:
            if current is None:  # deleted (a process of this run that ended gave back its own taking): not taken
                self.store.create(self._body())
                return True
            if current[0].get("run") != self.run:
                raise Conflict("taken")
            self.store.replace(self._body(), current[1])
            return True
        except Conflict:
            now = self.store.read()
            self.lost = (f"{self.url}: the run lease was taken by "
                         f"{self.describe(now[0]) if now else 'nobody (it was deleted)'}")
            return False

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew every ttl/4 s on a thread until release(); `on_lost(why)` when it is lost. A
        store that does not answer is retried at the next interval (the lease may then expire:
        a run that cannot reach its store cannot write its steps there either)."""
        def loop() -> None:
            while not self._stop.wait(self.ttl / 4):
                try:
                    if not self.renew():
                        on_lost(self.lost)
                        return
                except Exception as exc:  # noqa: BLE001 (an outage: the uploads say so themselves)
                    log.warning("could not renew the run lease on %s: %s", self.url, exc)
        self._thread = threading.Thread(target=loop, name="checkpoint-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the lease back (the run ended or stopped cleanly): a restart takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.lost or not self.held:
            return
        try:
            current = self.store.read()
            if current is not None and current[0].get("run") == self.run and current[0].get("holder") == self.holder \
                    and current[0].get("token", self.token) == self.token:
                self.store.delete()  # (not when another process or taking of the same run took it over since)
        except Exception as exc:  # noqa: BLE001 (it then expires by itself)
            log.warning("could not release the run lease on %s (%s): it expires in %.0f s", self.url, exc, self.ttl)


def take(remote: Location, on_lost: Callable[[str], None], env: Mapping[str, str] | None = None,
         handed: Mapping[str, Any] | None = None) -> Lease:
    """The run's lease on `remote`, kept renewed; LeaseHeld when another run holds it. A store
    out of reach (or refusing: the start-up listing says so and stops the run) does not stop
    the start here: the lease is taken at the first renewal that reaches it. `handed`: the lease
    this process's fetch process took for it before torch was imported (training/ckpt/
    fetch_process.py `lease_answer`), held now with no request to the store (renewed at once when
    half its time has gone meanwhile). A refusal it met is asked again here: it may have expired."""
    lease = Lease(remote, run_identity(os.environ if env is None else env))
    if handed is not None and handed.get("lease") == "held" and handed.get("run") == lease.run:
        lease.held, lease.token = True, str(handed["token"])  # (lease_line: a held line has its token)
        try:
            lease.expires = float(handed.get("expires", 0))
        except (TypeError, ValueError):
            lease.expires = 0.0  # renewed at once
        if lease.expires - lease.clock() < lease.ttl / 2:
            try:
                renewed = lease.renew()
            except Exception as exc:  # noqa: BLE001 (an outage: the renewals retry it)
                log.warning("could not renew the run lease on %s yet (%s)", remote.url, exc)
                renewed = True
            if not renewed:
                raise LeaseHeld(lease.lost)
    else:
        try:
            lease.acquire()
        except LeaseHeld:
            raise
        except Exception as exc:  # noqa: BLE001 (an outage at start: said once, taken later)
            log.warning("could not take the run lease on %s yet (%s): training goes on; it is taken once the store "
                        "answers", remote.url, exc)
    lease.keep(on_lost)
    return lease
