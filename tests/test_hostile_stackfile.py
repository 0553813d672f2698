"""The stack file tried as an attacker and a tired user would (issue 28): duplicate keys, secrets
in clear, stack names that would reach a path or a command, the real calendar, hand-edited team
stacks, and values that cannot work (a spot cap below the market, a RAM cache larger than the
node, YAML booleans as numbers, IPv6 and public scrape ranges), each refused naming its key."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.core.errors import SpecError
from infra.stack.stackfile import StackFileError, check_stack_name, read_stack_text
from tests.harness import parse_spec as parse
from tests.harness import ROOT, key, project_copy, spec_raw, stack_values, write_stack
from tests.test_hostile_input import _plan


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
    """networks[].scrapeCidrs opens the nodes' exporters to its ranges (infra/model/scrape.py): the
    internet, a split of it, or any public /24 is refused naming the entry."""
    problems = _problems(lambda c: c[key("networks")][0].__setitem__("scrapeCidrs", cidrs))
    assert any(f"networks[0].scrapeCidrs[{bad}]" in p and "not a private range" in p for p in problems), problems
    config = stack_values("dev")
    config[key("networks")][0]["scrapeCidrs"] = ["10.9.0.0/24"]
    parse(spec_raw(config))  # a private source passes
