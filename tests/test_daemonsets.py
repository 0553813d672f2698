"""Every node agent's DaemonSet (the NVIDIA and EFA device plugins, the DCGM and node exporters)
is built by one function, infra/k8s/daemons.py daemonset(): the shape they share (node-critical,
the GPU taint tolerated, no service-account token, host paths as volumes) is written once."""

from __future__ import annotations

import ast
import re

from tests.harness import ROOT


def _calls_in(source: str, where: str) -> list[str]:
    """`where:line in function` for each call of DaemonSet(...) or <anything>.DaemonSet(...) in a
    module's source, `in <module>` for one outside any function."""
    tree = ast.parse(source)
    owner: dict[int, str] = {}  # node -> the innermost function around it (ast.walk goes outer first)
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(func):
                if node is not func:
                    owner[id(node)] = getattr(func, "name", "<lambda>")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func
            name = callee.attr if isinstance(callee, ast.Attribute) else callee.id if isinstance(callee, ast.Name) else ""
            if name == "DaemonSet":
                found.append(f"{where}:{node.lineno} in {owner.get(id(node), '<module>')}")
    return found


def _daemonset_calls() -> list[str]:
    """The DaemonSet(...) calls under infra/."""
    found = []
    for path in sorted((ROOT / "infra").rglob("*.py")):
        found += _calls_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return sorted(set(found))


def test_one_function_builds_every_daemonset() -> None:
    calls = _daemonset_calls()
    assert len(calls) == 1 and calls[0].startswith("infra/k8s/daemons.py:") and calls[0].endswith(" in daemonset"), \
        f"DaemonSets built in more than one place (build them with infra/k8s/daemons.py daemonset()): {calls}"


def test_the_walk_sees_every_form_of_the_call() -> None:
    source = """from pulumi_kubernetes.apps.v1 import DaemonSet
import pulumi_kubernetes as k8s
module_level = DaemonSet("a")
also = k8s.apps.v1.DaemonSet("b")
def outer():
    def inner():
        return DaemonSet("c")
    return k8s.apps.v1.DaemonSet("d"), (lambda: DaemonSet("e"))
"""
    assert _calls_in(source, "x.py") == ["x.py:3 in <module>", "x.py:4 in <module>", "x.py:7 in inner",
                                         "x.py:8 in outer", "x.py:8 in <lambda>"]


def test_a_device_plugins_name_comes_from_its_image_tagged_or_digest_pinned() -> None:
    """The fabric device plugin's DaemonSet is named after its image's repository: a tag or a
    digest (`@sha256:…`) is no part of the name, which must be a DNS-1123 label."""
    from infra.k8s.daemons import repository_name

    digest = "sha256:" + "0" * 64
    for image in ("602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.5.6",
                  f"602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin@{digest}",
                  f"registry.example:5000/eks/aws-efa-k8s-device-plugin:v0.5.6@{digest}",
                  "aws-efa-k8s-device-plugin"):
        name = repository_name(image)
        assert name == "aws-efa-k8s-device-plugin", image
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name), name
