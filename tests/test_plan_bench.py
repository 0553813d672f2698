"""infra/plan/bench.py's machinery: the plan group scaled and interleaved in the balanced order, the
floors registering the plan's own resources (untyped, typed, structured) exactly as the plan did,
the report's per-resource lines, a failed floor never a figure. No time is asserted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from infra.plan import bench_floors
from training import benchorder


def test_the_plan_group_scales_the_stack_and_balances_every_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-resource figure plans the stack at 2x its node groups (copies renamed, in a scratch
    folder) and fits slopes; every run of the group is interleaved in benchorder's order."""
    import yaml

    from infra.plan import bench as plan_bench

    name = plan_bench.scaled_stack("dev", 2, tmp_path)
    key = "gpu-training-stack:nodeGroups"
    groups = yaml.safe_load((plan_bench.ROOT / "Pulumi.dev.yaml").read_text())["config"][key]
    doubled = yaml.safe_load((tmp_path / f"Pulumi.{name}.yaml").read_text())["config"][key]
    names = [g["name"] for g in doubled]
    assert len(doubled) == 2 * len(groups) and len(set(names)) == len(names)
    env = plan_bench._env()
    assert len(plan_bench.records(name, tmp_path, env)) > len(plan_bench.records("dev", plan_bench.ROOT, env))
    assert plan_bench.slope([(100, 1.0), (200, 1.5), (400, 2.5)]) == pytest.approx(0.005)

    order: list[str] = []
    runs = {n: ([n], plan_bench.ROOT) for n in ("plan@1", "plan@2", "floor@1", "floor@2", "floor_gc@1", "imports")}
    monkeypatch.setattr(plan_bench, "_runs", lambda *a: (runs, {1: 10, 2: 20}, [], []))
    def timed(cmd: list[str], cwd: Path) -> tuple[float, float | None]:
        order.append(cmd[0])
        return 1.0, (None if cmd[0] == "imports" else 0.5)

    monkeypatch.setattr(plan_bench, "_timed", timed)
    found = plan_bench.measure("dev", 3, (1, 2))
    assert order == [n for rep in range(3) for n in benchorder.order(list(runs), rep)]
    assert order[:6] == ["plan@1", "plan@2", "imports", "floor@1", "floor_gc@1", "floor@2"]
    assert all(len(v) == 3 for v in found["times"].values())  # type: ignore[attr-defined]
    work = found["work"]
    assert isinstance(work, dict) and work["imports"] == [] and all(len(work[n]) == 3 for n in runs if n != "imports")


def test_the_replay_floor_registers_the_plans_own_resources(tmp_path: Path) -> None:
    """The second limit of the plan group re-registers, at each scale, exactly the resources the
    plan registered (same count, same types), untyped, through the same engine; it is run with
    the other commands of the group."""
    import json
    import subprocess

    from infra.plan import bench as plan_bench

    runs, counts, sdks, imported = plan_bench._runs("dev", [1, 2], tmp_path)
    assert {"replay@1", "replay@2", "floor@1", "floor@2", "plan@1", "plan@2"} <= set(runs)
    # the floors import the SDK modules of the provider functions the plan calls as well as its
    # resources' (dev calls some: the caller's identity, Tencent's image lookup)
    types = {r["type"] for s in (1, 2) for r in json.loads((tmp_path / f"replay-{s}.json").read_text())}
    from_invokes = set(sdks) - set(plan_bench.sdk_modules(types))
    assert from_invokes and all(m in imported or "." not in m for m in from_invokes)
    for scale, key in ((1, "replay"), (2, "replay"), (1, "typed"), (2, "typed"), (1, "structured"), (2, "structured")):
        cmd, cwd = runs[f"{key}@{scale}"]
        resources = json.loads((tmp_path / f"replay-{scale}.json").read_text())
        assert len(resources) == counts[scale] and {r["type"] for r in resources} >= {"aws:ec2/vpc:Vpc"}
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=plan_bench._env(), timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert int(done.stdout.split()[-1]) == counts[scale]
    assert counts[2] > counts[1]
    for name in ("plan@1", "floor@1", "replay@2"):  # each times its own work after the SDK imports
        wall, work = plan_bench._timed(*runs[name])
        assert work is not None and 0 < work < wall, name


def test_the_plan_report_gives_every_limit_per_resource(capsys: pytest.CaptureFixture[str]) -> None:
    from infra.plan import bench as plan_bench

    times = {"plan@1": [9.0] * 3, "plan@2": [9.0] * 3, "floor@1": [5.0] * 3, "floor@2": [5.0] * 3,
             "replay@1": [6.0] * 3, "replay@2": [6.0] * 3, "typed@1": [8.0] * 3, "typed@2": [8.0] * 3,
             "structured@1": [8.5] * 3, "structured@2": [8.5] * 3, "floor_gc@1": [6.0] * 3, "imports": [4.0] * 3}
    # the slopes come from the work each process timed after its imports, not the process times
    work = {"plan@1": [2.0] * 3, "plan@2": [3.0] * 3, "floor@1": [1.0] * 3, "floor@2": [1.0] * 3,
            "replay@1": [1.5] * 3, "replay@2": [2.0] * 3, "typed@1": [1.6] * 3, "typed@2": [2.4] * 3,
            "structured@1": [1.8] * 3, "structured@2": [2.7] * 3, "floor_gc@1": [1.2] * 3, "imports": []}
    plan_bench._report({"stack": "dev", "resources": {1: 100, 2: 200}, "times": times, "work": work, "extra": []})
    lines = [line for line in capsys.readouterr().out.splitlines() if "per resource" in line]
    assert len(lines) == 4
    assert "LIMIT SUSPECT" in lines[0] and "x   target" not in lines[0]  # the trivial floor did not grow
    assert "replay floor 5.00 ms" in lines[1] and " 2.00x" in lines[1] and "target" not in lines[1]
    assert "typed floor 8.00 ms" in lines[2] and " 1.25x" in lines[2] and "what the program adds" in lines[2]
    assert "structured floor 9.00 ms" in lines[3] and " 1.11x" in lines[3] and "the program, policies" in lines[3]
    work |= {"structured@1": [1.0] * 3, "structured@2": [3.0] * 3}  # grows faster than the plan: no bound
    plan_bench._report({"stack": "dev", "resources": {1: 100, 2: 200}, "times": times, "work": work, "extra": []})
    line = [x for x in capsys.readouterr().out.splitlines() if "structured floor" in x and "per resource" in x][0]
    assert "LIMIT SUSPECT: the floor grew faster than the plan" in line and "x   (" not in line


def test_a_floor_that_fails_is_never_a_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 1 is the plan's policy verdict after its work; exit 1 before any work (a floor's
    SystemExit) or any other exit fails the bench, naming the run."""
    import subprocess

    from infra.plan import bench as plan_bench

    def run(rc: int, stderr: bytes) -> Callable[..., subprocess.CompletedProcess[bytes]]:
        return lambda cmd, **kw: subprocess.CompletedProcess(cmd, rc, b"", stderr)

    monkeypatch.setattr(subprocess, "run", run(1, b"violations\nGTS_WORK_S=0.5\n"))
    assert plan_bench._timed(["python", "-c", "plan"])[1] == 0.5
    for rc, err in ((1, b"typed floor: aws:ec2/vpc:Vpc has no argument for input 'x'\n"), (2, b"GTS_WORK_S=0.5\n")):
        monkeypatch.setattr(subprocess, "run", run(rc, err))
        with pytest.raises(RuntimeError, match=f"python -c floor failed \\({rc}\\)"):
            plan_bench._timed(["python", "-c", "floor"])

@pytest.mark.parametrize("stack", ["dev", "prod", "team-vision"])
def test_the_structured_floor_registers_the_plans_links_and_options(stack: str) -> None:
    """The structured floor registers every resource the program registered with the same parent,
    provider, dependencies and options (aliases, protect, ...), in an order where each comes after
    what it names (the engine lists them as they completed): its slope against the plan's is the
    program's own work, nothing of the SDK's left out."""
    from infra.plan import bench as plan_bench
    from infra.plan.engine import run_program
    from infra.stack.stackfile import StackConfig, project_name

    recorded = plan_bench.records(stack, plan_bench.ROOT, plan_bench._env())
    config = StackConfig(project=project_name(), stack=stack, values={}, secret_keys=[])  # the plan's URNs
    replay = bench_floors.replay_program(recorded, True, structured=True)
    got = {g.urn: g for g in run_program(config, {}, program=replay)}
    assert set(got) == {r["urn"] for r in recorded}
    assert any(r["parent"] in got for r in recorded) and any(r["options"]["dependencies"] for r in recorded)
    assert any(r["options"]["aliases"] for r in recorded)  # derived by the SDK, as the plan's are
    for r in recorded:
        g = got[r["urn"]]
        assert (g.parent, g.provider.rsplit("::", 1)[0], g.custom, g.options) == \
            (r["parent"], r["provider"].rsplit("::", 1)[0], r["custom"], r["options"]), r["urn"]
        assert g.masked() == r["inputs"], r["urn"]
    # every resource whose type has an SDK class is built through it (the floor never turns untyped)
    made_by = {links["urn"]: make for make, _args, _kwargs, links in replay.calls}
    for r in recorded:
        found = bench_floors.sdk_class(r["type"])
        if found is not None and not r["type"].startswith("pulumi:providers:"):
            assert made_by[r["urn"]] is found[0], r["urn"]


def test_the_structured_floor_refuses_a_link_it_cannot_make() -> None:
    def record(urn: str, parent: str = "", deps: tuple[str, ...] = ()) -> dict[str, object]:
        return {"type": "aws:s3/bucket:Bucket", "name": urn.rsplit("::", 1)[1], "urn": urn, "parent": parent,
                "provider": "", "custom": True, "inputs": {}, "options": {"dependencies": list(deps)}}

    a, b, root = "urn:pulumi:s::p::aws:s3/bucket:Bucket::a", "urn:pulumi:s::p::aws:s3/bucket:Bucket::b", \
        "urn:pulumi:s::p::pulumi:pulumi:Stack::p-s"
    ordered = bench_floors._linked_first([record(b, root, (a,)), record(a, root)])
    assert [r["urn"] for r in ordered] == [a, b]  # after what it names; the root stack is no record
    with pytest.raises(SystemExit, match="linked to itself"):
        bench_floors._linked_first([record(a, "", (b,)), record(b, "", (a,))])
    with pytest.raises(SystemExit, match="names urn:pulumi:s::p::aws:s3/bucket:Bucket::gone, which the plan"):
        bench_floors._linked_first([record(a, "", ("urn:pulumi:s::p::aws:s3/bucket:Bucket::gone",))])


@pytest.mark.parametrize("stack", ["dev", "prod", "team-vision"])
def test_the_typed_floor_registers_the_plans_inputs_through_the_sdks_classes(stack: str) -> None:
    """The typed floor builds each resource through its type's SDK class with the plan's recorded
    inputs: the engine records exactly the plan's inputs again (a declared secret wrapped), and a
    recorded input the class has no argument for stops it, named (no input is dropped)."""
    import contextlib
    import io
    import json

    import pulumi_aws

    from infra.plan.__main__ import main
    from infra.plan.engine import run_program
    from infra.stack.stackfile import StackConfig

    def unwrapped(value: object) -> object:
        if isinstance(value, dict):
            secret = "4dabf18193072939515e22adb298388d"
            return unwrapped(value["value"]) if secret in value else {k: unwrapped(v) for k, v in value.items()}
        return [unwrapped(v) for v in value] if isinstance(value, list) else value

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--stack", stack, "--format", "json"])
    resources = json.loads(out.getvalue())["resources"]
    config = StackConfig(project="bench", stack="bench", values={}, secret_keys=[])
    got = {(g.type, g.name): g for g in run_program(config, {}, program=bench_floors.replay_program(resources, True))}
    assert len(got) == len(resources)
    for r in resources:
        assert unwrapped(json.loads(json.dumps(got[(r["type"], r["name"])].inputs))) == r["inputs"], r["name"]
    found = bench_floors.sdk_class("aws:ec2/vpc:Vpc")
    assert found is not None and found[0] is pulumi_aws.ec2.Vpc and "cidr_block" in found[1]
    assert bench_floors.sdk_class("pulumi:providers:aws") is None
    vpc = next(r for r in resources if r["type"] == "aws:ec2/vpc:Vpc")
    hostile = [dict(vpc, inputs={**vpc["inputs"], "noSuchArgument": 1})]
    with pytest.raises(SystemExit, match="aws:ec2/vpc:Vpc has no argument for input 'noSuchArgument'"):
        bench_floors.replay_program(hostile, True)
    for own in ("resourceName", "opts"):  # the constructor's own parameters are no input's
        with pytest.raises(SystemExit, match=f"no argument for input '{own}'"):
            bench_floors.replay_program([dict(vpc, inputs={**vpc["inputs"], own: "x"})], True)
