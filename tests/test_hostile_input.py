"""What a user writes in a stack file, tried as an attacker and a tired user would (issue 28):
it never runs as root on a node, never reads differently to the node's three readers of
node.env (bash, systemd, docker), never hides behind a duplicate key, never sits in a stack file
in clear, and a stack name never reaches a path or a command unchecked. This file covers the
values that reach node.env; the stack file itself, stack names, the calendar and values that
cannot work are in tests/test_hostile_stackfile.py."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import userdata
from infra.core.errors import SpecError
from infra.model.spec import StackSpec
from infra.rendezvous import sites
from infra.resolve.groups import resolve
from tests.harness import parse_spec as parse
from tests.harness import ROOT, key, project_copy, spec_raw, stack_values, write_stack


HOSTILE = ["https://m.example/ubuntu$(touch PWNED)", "https://m.example/x\nGTS_BUNDLE_SHA256=evil",
           "https://m.example/a&b=c", "https://m.example/`touch PWNED`", "https://m.example/a b",
           "https://m.example/a;touch PWNED", "https://m.example/'q'", 'https://m.example/"q"',
           "https://m.example/a\\b", "https://m.example/#frag", "https://m.example/${GTS_BUNDLE_URL}",
           "https://m.example/~root"]
PASSWORD_URL = "https://admin:hunter2@m.example/x"  # lands in user data in clear: refused in URLs
# Every stack value that reaches node.env as it is written (the others are names, numbers,
# literals, checked regions, or encoded like training.command).
ENV_FIELDS = {
    "clouds.alicloud.mirrors.apt": lambda c, v: c[key("clouds")]["alicloud"]["mirrors"].__setitem__("apt", v),
    "clouds.alicloud.mirrors.nvidia": lambda c, v: c[key("clouds")]["alicloud"]["mirrors"].__setitem__("nvidia", v),
    "clouds.tencentcloud.mirrors.dockerHub":
        lambda c, v: c[key("clouds")]["tencentcloud"]["mirrors"].__setitem__("dockerHub", v),
    "clouds.tencentcloud.mirrors.pip": lambda c, v: c[key("clouds")]["tencentcloud"]["mirrors"].__setitem__("pip", v),
    "clouds.alicloud.mirrors.registry":
        lambda c, v: c[key("clouds")]["alicloud"]["mirrors"].__setitem__("registry", v.replace("https://", "")),
    "training.mlflowTrackingUri": lambda c, v: c[key("training")].__setitem__("mlflowTrackingUri", v),
    "training.prebuiltImages.aws": lambda c, v: c[key("training")].__setitem__(
        "prebuiltImages", {"aws": v.replace("https://", "") + "@sha256:" + "a" * 64}),
    "training.image": lambda c, v: c[key("training")].__setitem__("image", v.replace("https://", "") + "@sha256:" + "a" * 64),
    "tags.owner": lambda c, v: c[key("tags")].__setitem__("owner", v.replace("https://", "")),
}


@pytest.mark.parametrize("field", sorted(ENV_FIELDS))
def test_hostile_values_are_refused_at_the_spec_with_their_key(field: str) -> None:
    for value in HOSTILE + ([] if field == "tags.owner" else [PASSWORD_URL]):
        config = stack_values("dev")
        ENV_FIELDS[field](config, value)
        with pytest.raises(SpecError) as caught:
            parse(spec_raw(config))
        assert any(p.path == field for p in caught.value.problems), (value, str(caught.value))
        if "mirrors" in field and "registry" not in field or "mlflow" in field:
            assert "hunter2" not in str(caught.value)  # a URL's password (a decrypted secret) is never echoed


# The edge of what the spec accepts: every punctuation mark it allows, in every free field.
EDGE = {
    "apt": "https://mirror.example:8443/a%2Fb+c,d=e-f_g.h/ubuntu",
    "mlflow": "http://mlflow.internal:5000/x%20y+z,=-_./q:r",
    "owner": "ml+platform@example.com:team/a=b,c%d",
    "command": ["-m", "mypkg.train", "--note", "$(touch PWNED) `touch PWNED`; echo hi & x\nGTS_BUNDLE_SHA256=evil",
                "--out", "${CHECKPOINT_DIR}"],
}


def edge_spec() -> StackSpec:
    config = stack_values("dev")
    config[key("clouds")]["alicloud"]["mirrors"]["apt"] = EDGE["apt"]
    config[key("training")]["mlflowTrackingUri"] = EDGE["mlflow"]
    config[key("training")]["command"] = EDGE["command"]
    config[key("tags")]["owner"] = EDGE["owner"]
    return parse(spec_raw(config))


def contexts(spec: StackSpec) -> Iterator[userdata.NodeContext]:
    stack = resolve(spec)
    for rg in stack.groups:
        yield userdata.node_context(spec, rg, userdata.IMAGE_PLACEHOLDER)
    for site in sites(spec, stack.groups):
        yield userdata.store_context(spec, site, userdata.IMAGE_PLACEHOLDER)


def expected(ctx: userdata.NodeContext) -> dict[str, str]:
    """What node.env means: the template's lines read by nobody but this test's own split."""
    out = {}
    for line in userdata.render_env(ctx).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            assert name not in out, f"{name} given twice"
            out[name] = value
    return out


def read_with_bash(path: Path, names: list[str], cwd: Path) -> dict[str, str]:
    script = 'set -a; . "$1"; for n in "${@:2}"; do printf "%s=%s\\0" "$n" "${!n}"; done'
    out = subprocess.run(["bash", "-c", script, "bash", str(path), *names], cwd=cwd, env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if item)


GENERATOR = Path("/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator")


def read_with_systemd(path: Path, tmp: Path) -> dict[str, str]:
    """systemd's own env-file parser (parse_env_file_internal, what EnvironmentFile= uses), run
    by its environment.d generator on a copy of the file; it prints each variable, quoted where
    the value holds anything but plain characters (then it would not read as written)."""
    home = tmp / "systemd-home"
    (home / "environment.d").mkdir(parents=True, exist_ok=True)
    (home / "environment.d" / "50-node.conf").write_text(path.read_text())
    out = subprocess.run([str(GENERATOR)], env={"XDG_CONFIG_HOME": str(home), "HOME": str(home)},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


class _Docker(http.server.BaseHTTPRequestHandler):
    """Just enough of the Docker Engine API for `docker create`: the CLI parses --env-file
    itself and sends the result as the container's Env."""

    protocol_version = "HTTP/1.1"
    created: list[dict[str, Any]] = []

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Api-Version", "1.45")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_HEAD(self) -> None:  # noqa: N802 (the handler's naming)
        self.send_response(200)  # /_ping: headers only
        self.send_header("Api-Version", "1.45")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        self._reply(200, {"ApiVersion": "1.45"})

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "/containers/create" in self.path:
            type(self).created.append(json.loads(body))
        self._reply(201, {"Id": "0" * 12, "Warnings": []})

    def log_message(self, *args: Any) -> None:
        pass


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def read_with_docker(path: Path, tmp: Path) -> dict[str, str]:
    """The real docker CLI's --env-file reading (what gts-trainer.service runs), sent to a
    stand-in daemon on a unix socket that records the container's Env."""
    # A unix socket path holds at most 107 bytes: pytest's temporary folders (per xdist worker)
    # can be longer, so the socket lives in a short folder of its own.
    short = Path(tempfile.mkdtemp(prefix="gts-docker-"))
    sock = short / "docker.sock"
    server = _Server(str(sock), _Docker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _Docker.created.clear()
        proc = subprocess.run(["docker", "create", "--env-file", str(path), "img@sha256:" + "0" * 64],
                       env={"DOCKER_HOST": f"unix://{sock}", "PATH": "/usr/bin:/bin:/usr/local/bin",
                            "HOME": str(tmp), "DOCKER_CONFIG": str(tmp / ".docker")},
                       capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        [created] = _Docker.created
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(short, ignore_errors=True)
    return dict(item.split("=", 1) for item in created["Env"])


def test_env_file_reads_the_same_to_bash_systemd_and_docker(tmp_path: Path) -> None:
    """Every node's env file of a stack using every character the spec allows (and a hostile
    training command, which is encoded): no command runs, no variable is overridden, and every
    variable reads the same to bash, systemd and docker as the stack meant it."""
    if not GENERATOR.exists():
        pytest.skip("systemd's environment.d generator is not installed")
    if subprocess.run(["sh", "-c", "command -v docker"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI is not installed")
    spec = edge_spec()
    seen = 0
    for ctx in contexts(spec):
        want = expected(ctx)
        folder = tmp_path / f"{ctx.cloud}-{ctx.group}"
        folder.mkdir()
        path = folder / "node.env"
        path.write_text(userdata.render_env(ctx))
        bash = read_with_bash(path, list(want), folder)
        systemd = read_with_systemd(path, folder)
        docker = read_with_docker(path, folder)
        for name, value in want.items():
            assert bash[name] == docker[name] == value, name
            # systemd's tokenizer hands an empty value on as NULL: EnvironmentFile='s
            # load_env_file_push writes strjoin(key, "=", NULL), i.e. KEY= (empty), while the
            # environment.d generator's merge_env_file_push skips the line (src/basic/env-file.c).
            assert systemd.get(name, "") == value, name
        assert not list(folder.rglob("PWNED")) and not (ROOT / "PWNED").exists()
        if ctx.cloud == "alicloud":
            assert want["GTS_APT_MIRROR"] == EDGE["apt"]
        seen += 1
    assert seen >= 6  # dev: VM and cluster groups on three clouds, and the rendezvous stores
    aws = next(c for c in contexts(spec) if c.cloud == "aws" and c.mode == "vm")
    assert aws.trainer["MLFLOW_TRACKING_URI"] == EDGE["mlflow"] and aws.trainer["GTS_TEAM"] == EDGE["owner"]
    from training.contract import decode_command
    assert decode_command(aws.trainer["TRAIN_COMMAND"]) == EDGE["command"]


def test_renderer_refuses_a_hostile_value_in_any_env_field() -> None:
    """A value the spec did not stop (a later change, a computed value) never reaches node.env:
    every string the template writes, and every trainer variable, is checked."""
    ctx = next(c for c in contexts(edge_spec()) if c.mode == "vm")
    fields = [f.name for f in dataclasses.fields(ctx) if isinstance(getattr(ctx, f.name), str)]
    assert len(fields) >= 15
    for name in fields:
        with pytest.raises(userdata.UnsafeEnvValue, match=f"GTS_{name.upper()}="):
            hostile: dict[str, Any] = {name: "x$(touch PWNED)"}
            userdata.render_env(dataclasses.replace(ctx, **hostile))
    for var in ctx.trainer:
        with pytest.raises(userdata.UnsafeEnvValue, match=var):
            userdata.render_env(dataclasses.replace(ctx, trainer={**ctx.trainer, var: "x\nGTS_BUNDLE_SHA256=evil"}))


def _plan(proj: Path, stack: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"], cwd=proj,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", **env})


def test_the_issues_node_env_cases_stop_the_plan_with_their_key(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    config = stack_values("dev")
    config[key("clouds")]["alicloud"]["mirrors"]["apt"] = "https://mirrors.aliyun.com/ubuntu$(touch PWNED)"
    config[key("training")]["mlflowTrackingUri"] = "http://mlflow:5000\nGTS_BUNDLE_SHA256=evil"
    write_stack(proj, "hostile", config)
    proc = _plan(proj, "hostile", GTS_TODAY=os.environ["GTS_TODAY"])
    assert proc.returncode == 2, proc.stderr
    assert "clouds.alicloud.mirrors.apt" in proc.stderr and "training.mlflowTrackingUri" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.rglob("PWNED"))
