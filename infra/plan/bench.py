"""The offline plan's figures for `make bench`: a stack's plan in a fresh process beside its limit,
the provider SDKs the stack uses imported plus Pulumi's mock engine registering as many trivial
resources as the plan has, in one fresh process. Interleaved, the order balanced per repeat
(training/benchorder.py), min / median of REPEATS.

The plan runs without the cyclic garbage collector (infra/plan/__main__.py says why), so the
headline limit runs that way too (like for like); the limit with the collector on is shown
beside it. The stack is also planned at 2x and 4x its node groups (each group copied under
another name, in a scratch folder) with the floor at the same resource counts, so the cost per
resource of each is a least-squares slope: the target (issue 44) is the plan's slope within 1.25x
of the floor's. A second limit, the replay floor, registers the plan's own resources with the
inputs the plan recorded (untyped, nothing computed) through the same engine: the engine's work
on the same payload, so the plan's slope against it is what the program and the SDK's typed
classes add. A third, the typed floor, builds the same resources through the SDK's class of each
type with the recorded inputs as arguments, flat and with no program: the plan's slope against it is
what the program adds, with the SDK's work on the parents, providers and dependencies it leaves out.
A fourth, the structured floor, is the typed floor with each resource's recorded parent, provider,
dependencies and options: the plan's slope over it is the stack program, the policy pack and the
rendering, plus the little SDK work the floor leaves out (infra/plan/bench_floors.py says what).

    python -m infra.plan.bench [--stack prod] [--repeats 3] [--scales 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from infra.plan.bench_floors import _FLOOR, _REPLAY, PAYLOAD_FLOORS, SDKS
from infra.plan.bench_floors import records as records  # re-exported: the tests record through this module
from infra.plan.bench_floors import sdk_modules as sdk_modules
from training import benchorder

ROOT = Path(__file__).resolve().parents[2]
TARGET = 1.5  # whole plan against the floor, like for like (issue 34)
SLOPE_TARGET = 1.25  # per resource (issue 44)

_IMPORTED = """
import contextlib, importlib, io, re, sys
pattern = re.compile(r"^(pulumi_[a-z_]+|tencentcloud_iac_pulumi)(\\.[a-z_0-9]+)?$")

def loaded():
    return {name for name, m in list(sys.modules.items()) if pattern.match(name) and name.count(".") == 1
            and type(m).__name__ != "_LazyModule" and not name.rsplit(".", 1)[1].startswith("_")
            and name.rsplit(".", 1)[1] not in ("config", "provider", "outputs")}

for package in sys.argv[2:]:  # what importing the SDK packages loads by itself is not the stack's choice
    importlib.import_module(package)
before = loaded()
from infra.plan import engine
from infra.plan.__main__ import main
invoked = set()
answer = engine.StackMocks.call

def call(self, args):  # the provider functions the program calls: their modules are the stack's too
    invoked.add(args.token)
    return answer(self, args)

engine.StackMocks.call = call
with contextlib.redirect_stdout(io.StringIO()):
    main(["--stack", sys.argv[1], "--format", "json"])
print("\\n".join(sorted(loaded() - before)))
print("\\n".join("INVOKE " + token for token in sorted(invoked)))
"""

# The plan as `python -m infra.plan` runs it (the collector off before any import), with the SDK
# modules the floor imports imported first and the clock started after them, as the floor's is:
# the per-resource slopes compare the work after the imports, which a loaded machine's noise on
# the imports (about 4 s of the 6) does not reach. The process's own wall time is kept as well.
_PLAN = """
import gc, importlib, sys, time
gc.disable()
for sdk in sys.argv[2:]:
    getattr(importlib.import_module(sdk), "_load_", None)
start = time.perf_counter()
from infra.plan.__main__ import main
code = main(["--stack", sys.argv[1], "--format", "json"])
print(f"GTS_WORK_S={time.perf_counter() - start:.6f}", file=sys.stderr)
sys.exit(code)
"""


def _timed(cmd: list[str], cwd: Path = ROOT) -> tuple[float, float | None]:
    """(the process's wall time, the work after its SDK imports as it timed itself, or None)."""
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900, env=_env())
    wall = time.perf_counter() - started
    work = [line for line in done.stderr.decode(errors="replace").splitlines() if line.startswith("GTS_WORK_S=")]
    # The plan exits 1 on policy violations (a copied group may add some) after its work; any other
    # exit, or a 1 before the work's end (a floor's error), is a failed run, never a figure.
    if done.returncode not in (0, 1) or (done.returncode == 1 and not work):
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({done.returncode}): {done.stderr[-2000:]!r}")
    return wall, (float(work[-1].split("=", 1)[1]) if work else None)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def scaled_stack(stack: str, scale: int, folder: Path) -> str:
    """A copy of Pulumi.<stack>.yaml in `folder` with every node group `scale` times (copies
    renamed), beside the project and team files it reads; returns its stack name."""
    for name in ("Pulumi.yaml", "teams.yaml", f"Pulumi.{stack}.yaml"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, folder / name)
    data = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text(encoding="utf-8"))
    config = data["config"]
    key = next(k for k in config if k.endswith(":nodeGroups"))
    groups = config[key]
    config[key] = [dict(g, name=g["name"][:20] + f"-x{k}") if k else g for k in range(scale) for g in groups]
    name = f"{stack}x{scale}"
    (folder / f"Pulumi.{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return name


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def _runs(stack: str, scales: list[int], folder: Path) -> tuple[dict[str, tuple[list[str], Path]], dict[int, int],
                                                                   list[str], list[str]]:
    """Every command of the group: the plan, the floor, the replay, typed and structured floors (collector off) at each
    scale, plus the floor with the collector on and the SDK imports at 1x; the resource count per
    scale."""
    counts: dict[int, int] = {}
    runs: dict[str, tuple[list[str], Path]] = {}
    sdks: list[str] = []
    types: set[str] = set()
    where: dict[int, tuple[str, Path]] = {}
    for scale in scales:
        name, cwd = where[scale] = (stack, ROOT) if scale == 1 else (scaled_stack(stack, scale, folder), folder)
        resources = records(name, cwd, _env())
        counts[scale] = len(resources)
        types |= {str(r["type"]) for r in resources}
        (folder / f"replay-{scale}.json").write_text(json.dumps(resources), encoding="utf-8")
    packages = sorted({SDKS[t.split(":")[0]] for t in types if t.split(":")[0] in SDKS} | {SDKS["random"]})
    out = subprocess.run([sys.executable, "-c", _IMPORTED, stack, *packages], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=900, env=_env()).stdout.split("\n")
    imported = [line for line in out if line and not line.startswith("INVOKE ")]
    # the floor imports the modules of the stack's resources and of the provider functions it calls
    sdks = sdk_modules(types | {line.split(" ", 1)[1] for line in out if line.startswith("INVOKE ")})
    for scale in scales:
        name, cwd = where[scale]
        runs[f"plan@{scale}"] = ([sys.executable, "-c", _PLAN, name, *sdks], cwd)
        runs[f"floor@{scale}"] = ([sys.executable, "-c", "import gc; gc.disable()\n" + _FLOOR, str(counts[scale]),
                                   *sdks], ROOT)
        for key, _what in PAYLOAD_FLOORS:
            runs[f"{key}@{scale}"] = ([sys.executable, "-c", "import gc; gc.disable()\n" + _REPLAY,
                                      str(folder / f"replay-{scale}.json"), key, *sdks], ROOT)
    runs["floor_gc@1"] = ([sys.executable, "-c", _FLOOR, str(counts[scales[0]]), *sdks], ROOT)
    runs["imports"] = ([sys.executable, "-c", "import importlib, sys\nfor m in sys.argv[1:]: "
                        "getattr(importlib.import_module(m), '_load_', None)", *sdks], ROOT)
    return runs, counts, sdks, imported


def measure(stack: str, repeats: int, scales: tuple[int, ...] = (1, 2, 4)) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="gts-plan-bench-"))
    try:
        runs, counts, sdks, imported = _runs(stack, sorted(set(scales)), folder)
        times: dict[str, list[float]] = {name: [] for name in runs}
        work: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for rep in range(repeats):
            for name in benchorder.order(names, rep):
                cmd, cwd = runs[name]
                wall, done = _timed(cmd, cwd)
                times[name].append(wall)
                if done is not None:
                    work[name].append(done)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    extra = sorted(set(imported) - {".".join(m.split(".")[:2]) for m in sdks})
    return {"stack": stack, "resources": counts, "sdks": sdks, "times": times, "work": work, "extra": extra}


def _report(found: dict[str, object]) -> None:
    times, counts = found["times"], found["resources"]
    assert isinstance(times, dict) and isinstance(counts, dict)
    scales = sorted(counts)
    one = scales[0]
    plan, floor, floor_gc = times[f"plan@{one}"], times[f"floor@{one}"], times[f"floor_gc@{one}"]
    print(f"\nplan of {found['stack']} ({counts[one]} resources), seconds from process start, min/median of "
          f"{len(plan)}, interleaved, order balanced per repeat")
    for scale in scales:
        p, f = times[f"plan@{scale}"], times[f"floor@{scale}"]
        print(f"  {scale}x ({counts[scale]:5d} resources)  plan {min(p):6.2f}/{_median(p):<6.2f}  floor (SDK imports + "
              f"engine, collector off as the plan runs) {min(f):6.2f}/{_median(f):<6.2f}  {_median(p) / _median(f):5.2f}x")
    print(f"  floor with the collector on  {min(floor_gc):6.2f}/{_median(floor_gc):<6.2f}   (the SDK modules alone "
          f"{_median(times['imports']):.2f})")
    print(f"  whole plan, like for like    {_median(plan) / _median(floor):6.2f}x   target <={TARGET:.1f}x")
    for key, what in PAYLOAD_FLOORS:
        for scale in (s for s in scales if f"{key}@{s}" in times):
            r = times[f"{key}@{scale}"]
            print(f"  {scale}x {key} floor (the plan's own resources and inputs, {what}, same engine) "
                  f"{min(r):6.2f}/{_median(r):<6.2f}  plan {_median(times[f'plan@{scale}']) / _median(r):5.2f}x")
    work = found["work"]
    assert isinstance(work, dict)
    print("  the work after the SDK imports, as each process timed itself (min/median):")
    for scale in scales:
        print(f"  {scale}x  " + "  ".join(f"{key} {min(work[f'{key}@{scale}']):5.2f}/{_median(work[f'{key}@{scale}']):<5.2f}"
                                        for key in ("plan", "floor", "replay", "typed", "structured") if f"{key}@{scale}" in work))
    if len(scales) > 1:  # slopes of the work after the SDK imports, each process timing itself
        ps = slope([(counts[s], _median(work[f"plan@{s}"])) for s in scales])
        for key in ("floor", "replay", "typed", "structured"):
            if not all(f"{key}@{s}" in work for s in scales):
                continue
            fs = slope([(counts[s], _median(work[f"{key}@{s}"])) for s in scales])
            # A floor that does not grow with its resources was measured under noise larger than
            # the work it bounds: flagged, its ratio not reported (a broken limit, not a good ratio).
            # So was one that grows faster than the plan it bounds (a lower bound above the work).
            ratio = f"{ps / fs:5.2f}x" if 0 < fs < ps else \
                f"LIMIT SUSPECT: the floor {'did not grow' if fs <= 0 else 'grew faster than the plan'}; ratio not reported"
            label = "floor" if key == "floor" else f"{key} floor"
            tail = {"floor": f"target <={SLOPE_TARGET:.2f}x",
                    "typed": "(what the program adds, with the parents, providers and dependencies the floor leaves out)",
                    "structured": "(the plan over the SDK and engine on the same links and options: the program, "
                                  "policies and rendering, and the outputs, Output inputs and invokes it leaves out)"}.get(key, "")
            print(f"  per resource: plan {ps * 1e3:.2f} ms, {label} {fs * 1e3:.2f} ms  {ratio}   {tail}".rstrip())
    extra = found["extra"]
    assert isinstance(extra, list)
    print(f"  SDK modules the plan imports beyond those of its resources and provider functions (argument types "
          f"its calls build): {', '.join(extra) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scales", default="1,2,4", help="node-group multiples to plan (comma-separated)")
    args = parser.parse_args(argv)
    _report(measure(args.stack, max(args.repeats, 3), tuple(int(x) for x in args.scales.split(","))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
