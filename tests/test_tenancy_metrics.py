"""Teams that share a cloud cannot reach each other's runs (issue 27): metrics endpoints listen
on the node's / pod's own address, never on every interface (the trainer's METRICS_ADDR, the
node units' exporters, cloudinit/scripts/gts-node-addr.sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.training_helpers import ROOT, free_port


# --- metrics endpoints: the node's / pod's address, never every interface ---------------------------

def _listening(port: int) -> list[str]:
    return subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("addr", ["", "127.0.0.1"])
def test_the_trainers_metrics_listen_on_one_address(addr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """METRICS_ADDR is what the stack sets (the node's private address from its default route,
    the pod's from the downward API); unset, the trainer keeps to loopback."""
    from training.trainer.metrics import Metrics

    if addr:
        monkeypatch.setenv("METRICS_ADDR", addr)
    else:
        monkeypatch.delenv("METRICS_ADDR", raising=False)
    port = free_port()
    Metrics(port, 1.0, {"group": "g"})
    listening = _listening(port)
    assert f"127.0.0.1:{port}" in listening and f"*:{port}" not in listening and f"0.0.0.0:{port}" not in listening


def test_the_node_units_bind_the_exporters_and_trainer_to_the_private_address() -> None:
    exporters = (ROOT / "cloudinit/units/gts-exporters.service").read_text()
    trainer = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    starts = [line for line in exporters.splitlines() if line.startswith("ExecStart=")]
    assert len(starts) == 2 and all("addr=$$(/usr/local/sbin/gts-node-addr.sh) || exit 1;" in line for line in starts)
    assert '-p "$$addr:9400:9400"' in starts[0] and '--web.listen-address="$$addr:9100"' in starts[1]
    assert "-p 9400:9400" not in exporters
    assert '-e METRICS_ADDR="$$(/usr/local/sbin/gts-node-addr.sh)"' in trainer


@pytest.mark.parametrize("route,addrs,want", [
    ("1.1.1.1 via 10.0.0.1 dev eth0 src 10.0.3.7 uid 0", "", "10.0.3.7"),
    ("", "2: eth0    inet 10.99.0.5/24 brd 10.99.0.255 scope global eth0", "10.99.0.5"),
    ("", "", None)])
def test_the_node_address_is_its_private_one_or_nothing(route: str, addrs: str, want: str | None,
                                                        tmp_path: Path) -> None:
    """gts-node-addr.sh: the default route's source, else the first global address; none at all
    is a failure (the exporters' unit then starts nothing rather than listen on every interface)."""
    stub = tmp_path / "ip"
    stub.write_text(f"#!/bin/sh\ncase \"$*\" in *route*) printf '%s' '{route}';; *) printf '%s' '{addrs}';; esac\n")
    stub.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "cloudinit/scripts/gts-node-addr.sh")], capture_output=True, text=True,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout=30)
    if want is None:
        assert proc.returncode == 1 and "no private IPv4 address" in proc.stderr and not proc.stdout
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == want, proc
