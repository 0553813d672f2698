"""Every node agent's DaemonSet (the NVIDIA and EFA device plugins, the DCGM and node exporters)
is built by one function, infra/k8s/daemons.py daemonset(): the shape they share (node-critical,
the GPU taint tolerated, no service-account token, host paths as volumes) is written once."""

from __future__ import annotations

import ast

from tests.harness import ROOT


def _daemonset_calls() -> list[str]:
    """`file:line in function` for each call of <anything>.DaemonSet(...) under infra/."""
    found = []
    for path in sorted((ROOT / "infra").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "DaemonSet":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} in {func.name}")
    return sorted(set(found))


def test_one_function_builds_every_daemonset() -> None:
    calls = _daemonset_calls()
    assert len(calls) == 1 and calls[0].startswith("infra/k8s/daemons.py:") and calls[0].endswith(" in daemonset"), \
        f"DaemonSets built in more than one place (build them with infra/k8s/daemons.py daemonset()): {calls}"
