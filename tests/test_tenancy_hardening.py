"""Issue 41's smaller items, on the plan and the node's units: EKS add-ons that run on nodes wait
for the node groups; the trainer container runs with no new privileges and without the default
capabilities a trainer never uses."""

from __future__ import annotations

import re

from tests.harness import ROOT


def test_eks_addons_that_run_on_nodes_wait_for_the_node_groups() -> None:
    from tests.harness import shipped

    for stack in ("dev", "prod"):
        resources = list(shipped(stack))
        clusters = [r for r in resources if r.type == "aws:eks/cluster:Cluster"]
        for cluster in clusters:
            prefix = cluster.name.removesuffix("-eks")
            addons = {r.inputs["addonName"]: r for r in resources if r.type == "aws:eks/addon:Addon"
                      and r.name.startswith(prefix + "-")}
            groups = {r.urn for r in resources if r.type == "aws:eks/nodeGroup:NodeGroup" and r.name.startswith(prefix)}
            assert groups and "eks-node-monitoring-agent" in addons, (stack, sorted(addons))
            for name, addon in addons.items():
                waits = set(addon.options.get("dependencies") or [])
                if name in ("vpc-cni", "eks-pod-identity-agent"):  # before compute: nodes need them
                    assert not waits & groups, (stack, name)
                else:
                    assert groups <= waits, (stack, name, sorted(groups - waits))


def test_the_trainer_container_gets_no_new_privileges_and_no_raw_sockets() -> None:
    unit = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    run = unit[unit.index("ExecStart=/bin/sh"):unit.index("ExecStop=")]
    assert "--security-opt no-new-privileges" in run
    dropped = set(re.findall(r"--cap-drop (\w+)", run))
    assert {"NET_RAW", "MKNOD", "SYS_CHROOT", "SETFCAP", "SETPCAP", "AUDIT_WRITE", "NET_BIND_SERVICE"} <= dropped
    assert "--privileged" not in run and "--cap-add" not in run, "only a fabric group's file adds IPC_LOCK"
