"""What a user writes in a stack file, tried as an attacker and a tired user would (issue 28):
it never runs as root on a node, never reads differently to the node's three readers of
node.env (bash, systemd, docker), never hides behind a duplicate key, never sits in a stack file
in clear, and a stack name never reaches a path or a command unchecked."""

from __future__ import annotations

import dataclasses
import datetime
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
from infra.errors import SpecError
from infra.groups import resolve
from infra.rendezvous import sites
from infra.spec import StackSpec
from infra.stackfile import StackFileError, check_stack_name, read_stack_text
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


# ------------------------------------------------------------------ the stack file itself

def test_duplicate_keys_are_refused_with_the_line() -> None:
    text = ("config:\n  gpu-training-stack:env: dev\n  gpu-training-stack:budget:\n    monthlyLimitUsd: 10\n"
            "    alertEmails: [a@example.com]\n  gpu-training-stack:budget:\n    monthlyLimitUsd: 20\n")
    with pytest.raises(StackFileError, match=r"Pulumi.x.yaml, line 6: key 'gpu-training-stack:budget' is given twice"):
        read_stack_text(text, "Pulumi.x.yaml", "gpu-training-stack")
    nested = "config:\n  gpu-training-stack:nodeGroups:\n    - scaling: {max: 50, max: 2}\n"
    with pytest.raises(StackFileError, match=r"line 3: key 'max' is given twice"):
        read_stack_text(nested, "Pulumi.x.yaml", "gpu-training-stack")


@pytest.mark.parametrize("name,value", [
    ("aws:secretKey", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"), ("aws:accessKey", "AKIAIOSFODNN7EXAMPLE"),
    ("alicloud:secretKey", "x" * 30), ("alicloud:accessKey", "LTAI" + "x" * 20),
    ("tencentcloud:secretKey", "y" * 32), ("tencentcloud:secretId", "AKID" + "z" * 32)])
def test_provider_credentials_in_clear_are_refused(name: str, value: str) -> None:
    with pytest.raises(StackFileError) as caught:
        read_stack_text(f"config:\n  {name}: {value}\n", "Pulumi.x.yaml", "gpu-training-stack")
    assert name in str(caught.value) and "pulumi config set --secret" in str(caught.value)
    encrypted = read_stack_text(f"config:\n  {name}:\n    secure: AAABAxyz==\n", "Pulumi.x.yaml", "gpu-training-stack")
    assert encrypted.secret_keys == [name]


def test_passwords_in_urls_are_refused_and_secure_values_pass() -> None:
    text = ("config:\n  gpu-training-stack:training:\n    image: x@sha256:0\n"
            "    mlflowTrackingUri: https://admin:hunter2@mlflow.example\n")
    with pytest.raises(StackFileError) as caught:
        read_stack_text(text, "Pulumi.x.yaml", "gpu-training-stack")
    assert "gpu-training-stack:training.mlflowTrackingUri" in str(caught.value)
    assert "pulumi config set --secret" in str(caught.value) and "hunter2" not in str(caught.value)
    secure = "config:\n  gpu-training-stack:training:\n    mlflowTrackingUri:\n      secure: AAABAxyz==\n"
    assert read_stack_text(secure, "Pulumi.x.yaml", "gpu-training-stack").secret_keys == [
        "gpu-training-stack:training"]


def test_secret_in_clear_stops_make_plan_with_exit_2(tmp_path: Path) -> None:
    proj = project_copy(tmp_path)
    config = stack_values("dev")
    config["aws:secretKey"] = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    write_stack(proj, "leaky", config)
    proc = _plan(proj, "leaky", GTS_TODAY=os.environ["GTS_TODAY"])
    assert proc.returncode == 2 and "aws:secretKey" in proc.stderr and "pulumi config set --secret" in proc.stderr
    assert "EXAMPLEKEY" not in proc.stderr


# Pulumi's rule (sdk/go/common/tokens/stack_name.go): 1-100 of [A-Za-z0-9_.-].
@pytest.mark.parametrize("name", ["dev; echo INJECTED >&2; true", "../etc/passwd", "a b", "", "x" * 101, "dev\n",
                                  "$(id)", "dev`id`"])
def test_bad_stack_names_are_refused_before_use(name: str) -> None:
    with pytest.raises(StackFileError, match="Pulumi stack name"):
        check_stack_name(name)


@pytest.mark.parametrize("name", ["dev", "team-vision", "Prod_2", "a.b", "x" * 100])
def test_pulumi_stack_names_pass(name: str) -> None:
    assert check_stack_name(name) == name


@pytest.mark.parametrize("module", ["infra.plan", "infra.cli.policy_config", "infra.cli.userdata",
                                    "infra.cli.monitoring"])
def test_python_entry_points_refuse_bad_stack_names(tmp_path: Path, module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--stack", "dev; echo INJECTED", "--out", str(tmp_path)]
                          if module != "infra.plan" else [sys.executable, "-m", module, "--stack", "../dev"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "GTS_TODAY": "2026-11-30"})
    assert proc.returncode == 2 and "Pulumi stack name" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_make_quotes_its_variables(tmp_path: Path) -> None:
    """The issue's injection through make: the stack name reaches the CLI as one argument and is
    refused there; nothing runs."""
    marker = tmp_path / "INJECTED"
    proc = subprocess.run(["make", "-s", "policy-config", f"STACK=dev; touch {marker}; true", f"OUT={tmp_path}/o o"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GTS_TODAY": "2026-11-30"})
    assert proc.returncode != 0 and "Pulumi stack name" in proc.stderr, proc.stderr
    assert not marker.exists()
    ok = subprocess.run(["make", "-s", "policy-config", "STACK=dev", f"OUT={tmp_path}/o o"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, env={**os.environ, "GTS_TODAY": "2026-11-30"})
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip()) == tmp_path / "o o" / "policy-config-dev.json"


# ------------------------------------------------------------------ the calendar

def test_a_fresh_clone_plans_on_the_real_date_and_years_ahead(tmp_path: Path) -> None:
    """No GTS_TODAY (the real calendar), then ten years on: the plan works; old prices are the
    prices-fresh advisory with their age and `make prices`."""
    proj = project_copy(tmp_path)
    for stack in ("dev", "prod"):
        (proj / f"Pulumi.{stack}.yaml").write_text((ROOT / f"Pulumi.{stack}.yaml").read_text())
    real = _plan(proj, "dev")
    assert real.returncode == 0, real.stderr
    ahead = (datetime.date.today() + datetime.timedelta(days=3650)).isoformat()
    for stack in ("dev", "prod"):
        proc = _plan(proj, stack, GTS_TODAY=ahead)
        assert proc.returncode == 0, proc.stderr
        [note] = [v for v in json.loads(proc.stdout)["violations"] if v["policy"] == "prices-fresh"]
        assert note["enforcement"] == "advisory" and "days old" in note["message"] and "make prices" in note["message"]


# ------------------------------------------------------------------ generated team stacks

def test_a_hand_edited_team_stack_is_refused_by_plan_and_policy_config(tmp_path: Path) -> None:
    """`team.gpus.aws.A100: 1000` written into the generated Pulumi.team-vision.yaml: make plan
    and make policy-config exit 2 naming the key and `make teams`; nothing is written."""
    proj = project_copy(tmp_path)
    for name in ("Pulumi.prod.yaml", "Pulumi.team-vision.yaml"):
        (proj / name).write_text((ROOT / name).read_text())
    assert _plan(proj, "team-vision", GTS_TODAY="2026-11-30").returncode == 0
    path = proj / "Pulumi.team-vision.yaml"
    path.write_text(path.read_text().replace("        A100: 16\n", "        A100: 1000\n", 1))
    proc = _plan(proj, "team-vision", GTS_TODAY="2026-11-30")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "gpu-training-stack:team.gpus.aws.A100" in proc.stderr and "make teams" in proc.stderr
    out = tmp_path / "out"
    config = subprocess.run([sys.executable, "-m", "infra.cli.policy_config", "--stack", "team-vision", "--out",
                             str(out)], cwd=proj, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": "2026-11-30"})
    assert config.returncode == 2 and "team.gpus.aws.A100" in config.stderr and "make teams" in config.stderr
    assert not out.exists()


# ------------------------------------------------------------------ values that cannot work

def _problems(edit: Any) -> list[str]:
    config = stack_values("dev")
    edit(config)
    with pytest.raises(SpecError) as caught:
        parse(spec_raw(config))
    return [str(p) for p in caught.value.problems]


def test_a_spot_cap_far_below_the_market_is_refused_with_the_arithmetic() -> None:
    def cap(value: float) -> Any:
        return lambda c: c[key("nodeGroups")][0]["market"].__setitem__("spotMaxPriceUsd", value)

    [problem] = _problems(cap(0.0001))
    assert problem.startswith("nodeGroups[0].market.spotMaxPriceUsd: $0.0001/h is far below the spot price of ")
    assert "on-demand x (1 - " in problem and "typical spot discount) = $" in problem and "never get capacity" in problem
    config = stack_values("dev")
    cap(5.0)(config)
    assert parse(spec_raw(config)).node_groups[0].market.spot_max_price_usd == 5.0  # a real cap passes


def test_a_ram_cache_larger_than_the_node_is_refused_with_the_arithmetic() -> None:
    problems = _problems(lambda c: c[key("storage")].__setitem__("datasetTmpfsGb", 100000))
    assert problems and all(p.startswith("storage.datasetTmpfsGb: 100000 GB of RAM cache does not fit node group ")
                            for p in problems)
    assert "GiB RAM - " in problems[0] and "GB at most" in problems[0]


@pytest.mark.parametrize("where,edit", [
    ("nodeGroups[0].scaling.max", lambda c: c[key("nodeGroups")][0]["scaling"].__setitem__("max", True)),
    ("nodeGroups[0].scaling.min", lambda c: c[key("nodeGroups")][0]["scaling"].__setitem__("min", False)),
    ("training.steps", lambda c: c[key("training")].__setitem__("steps", True)),
    ("storage.datasetTmpfsGb", lambda c: c[key("storage")].__setitem__("datasetTmpfsGb", True)),
    ("budget.thresholdsPercent[0]", lambda c: c[key("budget")].__setitem__("thresholdsPercent", [True]))])
def test_a_yaml_boolean_is_not_read_as_a_number(where: str, edit: Any) -> None:
    problems = _problems(edit)
    assert any(p.startswith(f"{where}: ") and "YAML boolean, not a number" in p for p in problems), problems


def test_an_ipv6_network_is_not_said_to_have_host_bits_set() -> None:
    problems = _problems(lambda c: c[key("networks")][0].__setitem__("cidr", "2001:db8::/32"))
    [problem] = [p for p in problems if p.startswith("networks[0].cidr")]
    assert "IPv6 network" in problem and "host bits" not in problem
    [host_bits] = _problems(lambda c: c[key("networks")][0].__setitem__("cidr", "10.0.0.1/16"))
    assert host_bits == "networks[0].cidr: '10.0.0.1/16' has host bits set; the network is 10.0.0.0/16 (write that)"


@pytest.mark.parametrize("cidrs,bad", [
    (["0.0.0.0/0"], 0), (["0.0.0.0/1", "128.0.0.0/1"], 0), (["10.0.0.0/8", "8.8.8.0/24"], 1)])
def test_scrape_sources_must_be_private(cidrs: list[str], bad: int) -> None:
    """networks[].scrapeCidrs opens the nodes' exporters to its ranges (infra/scrape.py): the
    internet, a split of it, or any public /24 is refused naming the entry."""
    problems = _problems(lambda c: c[key("networks")][0].__setitem__("scrapeCidrs", cidrs))
    assert any(f"networks[0].scrapeCidrs[{bad}]" in p and "not a private range" in p for p in problems), problems
    config = stack_values("dev")
    config[key("networks")][0]["scrapeCidrs"] = ["10.9.0.0/24"]
    parse(spec_raw(config))  # a private source passes
