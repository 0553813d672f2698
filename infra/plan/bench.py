"""The offline plan's figures for `make bench`: a stack's plan in a fresh process beside its limit,
the provider SDKs the stack uses imported plus Pulumi's mock engine registering as many trivial
resources as the plan has, in one fresh process. Interleaved (plan, limit; limit, plan; ...),
min / median of REPEATS; the target (issue 34) is the plan within 1.5x of the limit. The plan runs
without the cyclic garbage collector (infra/plan/__main__.py says why); the limit is shown as is
and, like for like, run the same way.

    python -m infra.plan.bench [--stack prod] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import keyword
import subprocess
import sys
import time
from pathlib import Path

from infra import clouds

ROOT = Path(__file__).resolve().parents[2]
TARGET = 1.5
# The Python package behind each provider prefix of a resource type.
SDKS = {**{p.provider: p.sdk_package for p in clouds.profiles()}, "kubernetes": "pulumi_kubernetes",
        "docker-build": "pulumi_docker_build", "random": "pulumi_random"}


def sdk_modules(types: set[str]) -> list[str]:
    """The SDK modules a set of resource types needs: `aws:ec2/instance:Instance` ->
    pulumi_aws.ec2, `tencentcloud:As/scalingGroup:ScalingGroup` -> tencentcloud_iac_pulumi.as_,
    a Kubernetes resource to the module of its API version, which holds its class
    (`kubernetes:batch/v1:Job` -> pulumi_kubernetes.batch.v1: importing pulumi_kubernetes.batch
    alone leaves v1 unloaded), a custom resource (`kubernetes:kueue.x-k8s.io/v1beta1:ClusterQueue`)
    -> pulumi_kubernetes.apiextensions."""
    found = set()
    for token in types:
        pkg, module = token.split(":")[:2]
        if pkg not in SDKS:
            continue
        name = module.split("/")[0].split(".")[0].lower()
        if name == "index":
            found.add(SDKS[pkg])
            continue
        name = name + "_" if keyword.iskeyword(name) else name
        candidate = f"{SDKS[pkg]}.{name}"
        if importlib.util.find_spec(candidate) is None and pkg == "kubernetes":
            candidate = "pulumi_kubernetes.apiextensions"
        elif pkg == "kubernetes" and "/" in module:
            version = module.split("/")[1]
            if importlib.util.find_spec(f"{candidate}.{version}") is not None:
                candidate = f"{candidate}.{version}"
        found.add(candidate)
    return sorted(found)


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
from infra.plan.__main__ import main
with contextlib.redirect_stdout(io.StringIO()):
    main(["--stack", sys.argv[1], "--format", "json"])
print("\\n".join(sorted(loaded() - before)))
"""

_FLOOR = """
import importlib, sys
import pulumi
from infra.plan.engine import run_program
from infra.stackfile import StackConfig
for sdk in sys.argv[2:]:
    getattr(importlib.import_module(sdk), "_load_", None)  # an attribute: the SDK's lazy module loads
count = int(sys.argv[1])

def program():
    for i in range(count):
        pulumi.CustomResource("bench:index:Resource", f"r{i}", {"value": i, "name": f"r{i}"})

run_program(StackConfig(project="bench", stack="bench", values={}, secret_keys=[]), {}, program=program)
"""


def _timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
    return time.perf_counter() - started


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measure(stack: str, repeats: int) -> dict[str, object]:
    plan = subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"], cwd=ROOT,
                          check=True, capture_output=True, text=True, timeout=900)
    resources = json.loads(plan.stdout)["resources"]
    sdks = sdk_modules({r["type"] for r in resources})
    packages = sorted({m.split(".")[0] for m in sdks} | {SDKS["random"]})
    imported = subprocess.run([sys.executable, "-c", _IMPORTED, stack, *packages], cwd=ROOT, check=True,
                              capture_output=True, text=True, timeout=900).stdout.split()
    runs = {
        "plan": [sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"],
        "limit": [sys.executable, "-c", _FLOOR, str(len(resources)), *sdks],
        "limit_nogc": [sys.executable, "-c", "import gc; gc.disable()\n" + _FLOOR, str(len(resources)), *sdks],
        "imports": [sys.executable, "-c", "import importlib, sys\nfor m in sys.argv[1:]: getattr(importlib.import_module(m), '_load_', None)",
                    *sdks],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(_timed(runs[name]))
    extra = sorted(set(imported) - {".".join(m.split(".")[:2]) for m in sdks})
    return {"stack": stack, "resources": len(resources), "sdks": sdks, "times": times, "extra": extra}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    found = measure(args.stack, max(args.repeats, 3))
    times = found["times"]
    assert isinstance(times, dict)
    plan, limit, imports, limit_nogc = times["plan"], times["limit"], times["imports"], times["limit_nogc"]
    print(f"\nplan of {found['stack']} ({found['resources']} resources), seconds from process start, min/median of "
          f"{len(plan)}, interleaved")
    print(f"  plan                         {min(plan):6.2f}/{_median(plan):<6.2f}")
    print(f"  limit: SDK imports + engine  {min(limit):6.2f}/{_median(limit):<6.2f}   "
          f"(the SDK modules alone {_median(imports):.2f})")
    print(f"  limit, collector off         {min(limit_nogc):6.2f}/{_median(limit_nogc):<6.2f}   (as the plan runs)")
    print(f"  ratio                        {_median(plan) / _median(limit):6.2f}x   target <={TARGET:.1f}x   "
          f"(like for like, collector off in both: {_median(plan) / _median(limit_nogc):.2f}x)")
    extra = found["extra"]
    assert isinstance(extra, list)
    print(f"  SDK modules imported that no resource of the stack needs: {', '.join(extra) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
