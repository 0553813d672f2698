"""A node booted for real: the plan's exact user data through real cloud-init under real systemd
(PID 1 of `systemd-nspawn -b`), in a network namespace with no route out, where the cloud's
metadata service answers on 169.254.169.254 (tests/metadata_server.py) and an object store (moto,
over TLS, refusing anything not signed with the role's current key) serves the node bundle.

Each boot is an overlay on the cached base root (tests/boot/image.py), kept for the scenario's
reboots. What the Deep Learning AMI brings is stood in: docker (tests/boot/docker, recording),
nvidia-smi, nvidia-ctk and an enabled docker.service (image_layer); the GPUs the node "has" are
the stand-ins' state (Node.gpus), so the GPU boot gate really runs and can fail."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, TypeVar

from tests.boot import repo
from tests.boot.image import base_image, cache_dir, image_layer
from tests.metadata_server import FakeMetadata

HERE = Path(__file__).parent
STORE_ADDRESS = "10.99.0.2"  # the object store (and ECR) inside the node's network namespace
# Each cloud's metadata service: its address, and the name the node resolves to it where it uses
# one (Tencent's metadata.tencentyun.com is 169.254.0.23; Alibaba's is 100.100.100.200).
METADATA = {"aws": ("169.254.169.254", ""), "alicloud": ("100.100.100.200", ""),
            "tencentcloud": ("169.254.0.23", "metadata.tencentyun.com")}
CLONE_NEWNET = 0x40000000
SETUP_KEY = "gts-boot-setup"  # the access key of the test's own requests to the store (never the node's)
T = TypeVar("T")


@functools.cache
def gpu_health() -> Any:
    """The node's gts-gpu-health.py as a module (its metadata paths and scaling API endpoints)."""
    import importlib.util
    import sys

    sys.path[:0] = [str(HERE.parent.parent / "training"), str(HERE.parent.parent / "training" / "node")]  # its `import cloudmeta`, `import node_replace`
    spec = importlib.util.spec_from_file_location("gts_gpu_health", HERE.parent.parent / "cloudinit/scripts/gts-gpu-health.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setns_thread(netns: str, fn: Callable[[], T]) -> T:
    """Run `fn` on a thread that has joined `netns`: the sockets it opens live there."""
    out: dict[str, Any] = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]


def _static_server(directory: Path, served: list[str]) -> Any:
    """Plain HTTP on STORE_ADDRESS:80 serving `directory` (the node's apt archive)."""
    import functools as ft
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            served.append(f"{self.command} {self.path} {args[1] if len(args) > 1 else ''}")

    return ThreadingHTTPServer((STORE_ADDRESS, 80), ft.partial(Handler, directory=str(directory)))


class Store:
    """moto over TLS on STORE_ADDRESS:443, answering for the clouds' storage and ECR host names;
    a request not signed with the metadata server's current key (or the test's own) is refused (403)."""

    def __init__(self, netns: str, workdir: Path, meta: FakeMetadata, names: tuple[str, ...],
                 static: dict[str, Path] | None = None):
        """`static`: host names answered from a folder instead (package mirrors: no signing)."""
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        ca = cache_dir() / "ca"
        key, csr, crt = workdir / "store.key", workdir / "store.csr", workdir / "store.crt"
        ext = workdir / "ext.cnf"
        ext.write_text("subjectAltName=" + ",".join([f"IP:{STORE_ADDRESS}", *(f"DNS:{n}" for n in names)]) + "\n")
        subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=store", "-keyout", str(key),
                        "-out", str(csr)], check=True, capture_output=True, timeout=60)
        subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca / "ca.crt"), "-CAkey",
                        str(ca / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(crt)],
                       check=True, capture_output=True, timeout=60)
        self.meta = meta
        self.refused: list[str] = []
        self.served: list[str] = []
        self.static = static or {}
        self.secrets: dict[str, str] = {}  # Alibaba OOS / Tencent SSM: name -> value (AWS SSM: moto)
        moto_app = DomainDispatcherApplication(create_backend_app)
        owner = self

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            auth = environ.get("HTTP_AUTHORIZATION", "")
            what = f"{environ['REQUEST_METHOD']} {environ.get('HTTP_HOST')}{environ.get('PATH_INFO')}"
            host = str(environ.get("HTTP_HOST", "")).split(":")[0]
            if host in owner.static:
                return owner.serve_static(owner.static[host], environ, start_response, what)
            if host.startswith("oos.") and host.endswith(".aliyuncs.com") or host == "ssm.tencentcloudapi.com":
                return owner.serve_secret(host, environ, start_response, what)
            if f"Credential={SETUP_KEY}/" not in auth and owner.meta.access_key() not in auth:
                owner.refused.append(what)
                start_response("403 Forbidden", [("Content-Type", "text/plain")])
                return [b"AccessDenied: not signed with the node role's credentials\n"]
            owner.served.append(what)
            return moto_app(environ, start_response)

        self.netns = netns
        self.server = _setns_thread(netns, lambda: make_server(STORE_ADDRESS, 443, app, threaded=True,
                                                               ssl_context=(str(crt), str(key))))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve_static(self, root: Path, environ: dict[str, Any], start_response: Callable[..., Any],
                     what: str) -> list[bytes]:
        path = (root / str(environ.get("PATH_INFO", "")).lstrip("/")).resolve()
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD") or not path.is_file() or root.resolve() not in path.parents:
            self.served.append(what + " 404")
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        self.served.append(what + " 200")
        data = path.read_bytes()
        start_response("200 OK", [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(data)))])
        return [b"" if environ["REQUEST_METHOD"] == "HEAD" else data]

    def serve_secret(self, host: str, environ: dict[str, Any], start_response: Callable[..., Any],
                     what: str) -> list[bytes]:
        """Alibaba's OOS GetSecretParameter (RPC, the key id in the query) and Tencent's SSM
        GetSecretValue (API 3.0, the key id in the Authorization header), as their references
        document the answers; only the node role's current key is served."""
        import json
        import urllib.parse

        if host.endswith(".aliyuncs.com"):
            query = dict(urllib.parse.parse_qsl(str(environ.get("QUERY_STRING", ""))))
            signer, action, name = query.get("AccessKeyId", ""), query.get("Action"), query.get("Name", "")
            body = {"RequestId": "r-1", "Parameter": {"Name": name, "Type": "Secret", "Value": self.secrets.get(name)}}
        else:
            size = int(environ.get("CONTENT_LENGTH") or 0)
            params = json.loads(environ["wsgi.input"].read(size) or b"{}")
            signer, action, name = str(environ.get("HTTP_AUTHORIZATION", "")), environ.get("HTTP_X_TC_ACTION"), \
                params.get("SecretName", "")
            body = {"Response": {"SecretName": name, "VersionId": "v1", "SecretString": self.secrets.get(name),
                                 "RequestId": "r-1"}}
        if self.meta.access_key() not in signer:
            self.refused.append(what)
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"AccessDenied: not signed with the node role's credentials\n"]
        if action not in ("GetSecretParameter", "GetSecretValue") or name not in self.secrets:
            self.served.append(what + " 404")
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [b'{"Code": "EntityNotExists"}']
        self.served.append(what + " 200")
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]

    def setup(self, fn: Callable[[], T]) -> T:
        """Run the test's own calls (setup_client) from inside the namespace."""
        return _setns_thread(self.netns, fn)

    @staticmethod
    def client(service: str, region: str) -> Any:
        """A boto3 client for the test's own calls to the store, with the test's credentials."""
        import boto3
        from botocore.config import Config

        return boto3.client(service, endpoint_url=f"https://{STORE_ADDRESS}", region_name=region,
                            aws_access_key_id=SETUP_KEY, aws_secret_access_key="setup",
                            verify=str(cache_dir() / "ca/ca.crt"), config=Config(s3={"addressing_style": "path"}))

    def stop(self) -> None:
        self.server.shutdown()


class Node:
    """One node's boots: an overlay over the base root, its seed, its namespace and servers."""

    def __init__(self, workdir: Path, cloud: str, user_data: bytes, hosts: tuple[str, ...],
                 instance: str = "i-0boot0000000001", nspawn_args: tuple[str, ...] = (), image: str = "dlami",
                 mirrors: tuple[str, ...] = ()):
        """`hosts`: the store's names (the bucket, storage, registry and scaling API endpoints),
        resolved by the node's /etc/hosts to the store and named in its certificate. `mirrors`:
        package mirror hosts (HTTPS, same address), each served from mirror(host)."""
        self.base = base_image()
        self.workdir = workdir
        self.upper, self.work, self.merged = workdir / "upper", workdir / "work", workdir / "merged"
        for d in (self.upper, self.work, self.merged):
            d.mkdir(parents=True, exist_ok=True)
        self.netns = f"gts-boot-{os.getpid()}-{abs(hash(workdir)) % 100000}"
        subprocess.run(["ip", "netns", "add", self.netns], check=True, capture_output=True)
        meta_address, meta_name = METADATA[cloud]
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{meta_address}/32", "dev", "lo"],
                    ["ip", "addr", "add", f"{STORE_ADDRESS}/32", "dev", "lo"]):
            subprocess.run(["ip", "netns", "exec", self.netns, *cmd], check=True, capture_output=True)
        self.meta = _setns_thread(self.netns, lambda: FakeMetadata(cloud, host=meta_address, port=80)).start()
        self.mirrors = workdir / "mirrors"
        hosts = (*hosts, *mirrors)
        self.store = Store(self.netns, workdir, self.meta, hosts, {m: self.mirrors / m for m in mirrors})
        self.rdzv_key = ""  # a multi-node group's key, where the scenario put it (tests/boot/scenario.py _store_key)
        self.archive_dir = workdir / "archive"
        self.archive_dir.mkdir(exist_ok=True)
        self.archive_served: list[str] = []
        self.archive = _setns_thread(self.netns, lambda: _static_server(self.archive_dir, self.archive_served))
        threading.Thread(target=self.archive.serve_forever, daemon=True).start()
        self.nfs_export = workdir / "nfs"  # the NFS "server": bound into the node at repo.NFS_EXPORT
        (self.nfs_export / "data").mkdir(parents=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.nspawn_args = (*nspawn_args, f"--bind={self.nfs_export}:{repo.NFS_EXPORT}")
        self.boots = 0
        seed = self.upper / "var/lib/cloud/seed/nocloud"
        seed.mkdir(parents=True)
        (seed / "user-data").write_bytes(user_data)  # the plan's bytes, unchanged
        self.set_instance(instance)
        etc_hosts = self.upper / "etc/hosts"
        etc_hosts.parent.mkdir(parents=True, exist_ok=True)
        etc_hosts.write_text("127.0.0.1 localhost gts-node\n"
                             + "".join(f"{STORE_ADDRESS} {n}\n" for n in (*hosts, repo.ARCHIVE_HOST))
                             + (f"{meta_address} {meta_name}\n" if meta_name else ""))
        image_layer(self.upper, image)

    def set_instance(self, instance: str) -> None:
        """The instance id: cloud-init's (the seed) and the metadata service's."""
        (self.upper / "var/lib/cloud/seed/nocloud/meta-data").write_text(
            f"instance-id: {instance}\nlocal-hostname: gts-node\n")
        self.meta.extra["/latest/meta-data/instance-id"] = instance
        self.instance = instance

    def packages(self, *packages: repo.Package, root: Path | None = None, flat: bool = False) -> None:
        """Serve these stand-in packages from the node's archive (tests/boot/repo.py), trusted by the
        node; `root`: another archive's folder (a mirror's, under mirror(host))."""
        key = repo.build(root or self.archive_dir / "debian", list(packages), cache_dir(), flat)
        trusted = self.upper / "etc/apt/trusted.gpg.d"
        trusted.mkdir(parents=True, exist_ok=True)
        (trusted / "gts-boot-archive.gpg").write_bytes(key)

    def mirror(self, host: str) -> Path:
        """The folder a package mirror host's HTTPS answers come from."""
        return self.mirrors / host

    def gpus(self, count: int, persistence: str = "Enabled", nvlinks: int = 0, diag: str = "pass") -> None:
        """The GPUs the node's stand-ins report (tests/boot/gpu): what nvidia-smi and dcgmi see."""
        state = self.upper / "var/lib/gts-gpu-stub"
        state.mkdir(parents=True, exist_ok=True)
        for name, value in (("gpus", count), ("persistence", persistence), ("nvlinks", nvlinks), ("diag", diag)):
            (state / name).write_text(f"{value}\n")

    def file(self, path: str) -> Path:
        """A file the node wrote (the overlay's upper layer) or the base image has."""
        upper = self.upper / path.lstrip("/")
        return upper if upper.exists() else self.base / path.lstrip("/")

    def drop_in(self, unit: str, text: str) -> None:
        """A test-only timing override (e.g. a shorter RestartSec), next to the unit under test."""
        d = self.upper / f"etc/systemd/system/{unit}.d"
        d.mkdir(parents=True, exist_ok=True)
        (d / "90-boot-test.conf").write_text(text)

    def boot(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.boots += 1
        log = open(self.workdir / f"console-{self.boots}.log", "wb")
        script = ("mkdir -p /run/systemd/nspawn && mount -t tmpfs tmpfs /run/systemd/nspawn && "
                  f"mount -t overlay overlay -o lowerdir={self.base},upperdir={self.upper},workdir={self.work} "
                  f"{self.merged} && exec systemd-nspawn -q -D {self.merged} -b --register=no --keep-unit "
                  f"--network-namespace-path=/run/netns/{self.netns} --console=pipe --hostname=gts-node {' '.join(self.nspawn_args)}")
        # A private mount namespace: nspawn's propagation tmpfs and the overlay vanish with it.
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120  # the container's PID 1 appears (then node.sh can enter it)
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(AssertionError):
                self.init_pid()
                return
            time.sleep(0.1)
        raise AssertionError(f"the container did not start: {(self.workdir / f'console-{self.boots}.log').read_text()[-3000:]}")

    def wait_exit(self, timeout: float) -> int:
        """The container's own exit: 0 after poweroff/halt, 133 after a reboot (systemd-nspawn(1))."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def init_pid(self) -> int:
        """The host pid of the container's PID 1."""
        assert self.proc is not None
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                nspid = [line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")][0]
                if len(nspid) > 1 and nspid[-1] == "1":
                    return pid
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
        raise AssertionError("the container has no PID 1 (it did not boot)")

    def sh(self, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A command inside the running node (its namespaces, as root)."""
        return subprocess.run(["nsenter", "-t", str(self.init_pid()), "-m", "-u", "-i", "-n", "-p", "--",
                               "/bin/sh", "-c", command], capture_output=True, text=True, timeout=timeout)

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 240) -> None:
        """Wait on an event the node produces (a file, a unit state), never a fixed time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"{what}: not seen (boot {self.boots})\n{self.journal_text()[-6000:]}")

    def docker_calls(self) -> list[str]:
        path = self.file("/var/log/gts-docker.calls")
        return path.read_text().splitlines() if path.exists() else []

    def journal(self) -> list[dict[str, Any]]:
        proc = subprocess.run(["journalctl", "-D", str(self.upper / "var/log/journal"), "-o", "json", "--no-pager"],
                              capture_output=True, text=True, timeout=120)
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    def journal_text(self) -> str:
        proc = subprocess.run(["journalctl", "-D", str(self.upper / "var/log/journal"), "-o", "short-precise",
                               "--no-pager"], capture_output=True, text=True, timeout=120)
        return proc.stdout

    def poweroff(self, timeout: float = 120) -> int:
        """SIGTERM to systemd-nspawn asks the container's systemd to shut down cleanly."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        with contextlib.suppress(AssertionError):
            os.kill(self.init_pid(), signal.SIGRTMIN + 4)  # systemd: poweroff
        return self.wait_exit(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.poweroff(timeout=60)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.store.stop()
        self.archive.shutdown()
        self.meta.stop()
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)


def bucket_host(env: dict[str, str]) -> tuple[str, str, str]:
    """(bucket, key, host name) of the bundle as the node's fetcher addresses it."""
    url = urllib.parse.urlsplit(env["GTS_BUNDLE_URL"])
    endpoint = urllib.parse.urlsplit(env["STORAGE_ENDPOINT_URL"]).netloc
    virtual = env.get("STORAGE_ADDRESSING_STYLE", "virtual") == "virtual"
    return url.netloc, url.path.lstrip("/"), f"{url.netloc}.{endpoint}" if virtual else endpoint
