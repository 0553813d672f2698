"""A node's zone for the peer tier's buddies (training/ckpt/peer/ring.py node_zone): GTS_ZONE where
set, else its cloud's metadata service's answer at the documented path (each cloud's
metadata.py ZONE_PATH, served here by the suite's metadata stand-in, IMDSv2's token included),
else none; what the service answers is checked before it names a zone, and an unreachable
service costs the zones, never the run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.metadata_server import FakeMetadata
from training import cloudmeta
from training.ckpt.peer.ring import node_zone

ROOT = Path(__file__).resolve().parents[1]
ZONES = {"aws": "us-east-1a", "alicloud": "cn-hangzhou-h", "tencentcloud": "ap-guangzhou-3"}


@pytest.mark.parametrize("cloud", sorted(ZONES))
def test_a_nodes_zone_comes_from_its_clouds_metadata_service(cloud: str) -> None:
    with FakeMetadata(cloud) as meta:
        env = {"GTS_CLOUD": cloud, "GTS_METADATA_URL": meta.url}
        assert node_zone(env) == ""  # the path not answered (404): no zone
        meta.extra[cloudmeta.cloud_metadata(cloud).ZONE_PATH] = ZONES[cloud]
        assert node_zone(env) == ZONES[cloud]
        assert node_zone({**env, "GTS_ZONE": "set-by-hand"}) == "set-by-hand"
        meta.extra[cloudmeta.cloud_metadata(cloud).ZONE_PATH] = "<html>a proxy's page</html>"
        assert node_zone(env) == ""


def test_without_a_cloud_or_a_reachable_service_there_is_no_zone(caplog: pytest.LogCaptureFixture) -> None:
    assert node_zone({}) == ""
    assert node_zone({"GTS_CLOUD": "aws", "GTS_METADATA_URL": "http://127.0.0.1:9"}) == ""
    assert "this node's zone is unknown" in caplog.text and "set GTS_ZONE" in caplog.text
    assert node_zone({"GTS_CLOUD": "nocloud"}) == ""


def _garbage_service() -> tuple[socket.socket, str]:
    """A metadata address that answers every request with a line that is not HTTP."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"garbage\r\n\r\n")
    threading.Thread(target=serve, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def _entrypoint_asks(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The entrypoint's own line that asks for the zone (from its peer block), run as the
    entrypoint runs it (bash, set -euo pipefail), then what its workers would inherit."""
    script = (ROOT / "training/node/entrypoint.sh").read_text(encoding="utf-8")
    block = script[script.index("export GTS_PEER_STORE="):script.index("cmd=(python -m training.node.rdzv_launch")]
    line = next(text.strip() for text in block.splitlines() if text.strip().startswith("GTS_ZONE="))
    assert "export GTS_ZONE" in block
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(["bash", "-c", f"set -euo pipefail\n{line}\nexport GTS_ZONE\necho \"zone=[$GTS_ZONE]\""],
                          cwd=ROOT, env={**env, "PATH": path}, capture_output=True, text=True, timeout=60)


def test_the_entrypoint_asks_once_and_its_workers_do_not_ask_again(caplog: pytest.LogCaptureFixture) -> None:
    """The entrypoint asks once and exports the answer as GTS_ZONE for its workers; a GTS_ZONE set,
    even empty, is an answer, not a reason to ask again; an answer that is not HTTP leaves no
    zone and the node goes on."""
    base = {k: v for k, v in os.environ.items() if k != "GTS_ZONE"}
    with FakeMetadata("aws") as meta:
        meta.extra[cloudmeta.cloud_metadata("aws").ZONE_PATH] = ZONES["aws"]
        asked = _entrypoint_asks({**base, "GTS_CLOUD": "aws", "GTS_METADATA_URL": meta.url})
        assert asked.returncode == 0 and asked.stdout == f"zone=[{ZONES['aws']}]\n", asked.stderr
    server, url = _garbage_service()
    try:
        garbage = {**base, "GTS_CLOUD": "aws", "GTS_METADATA_URL": url}
        broken = _entrypoint_asks(garbage)
        assert broken.returncode == 0 and broken.stdout == "zone=[]\n", broken.stderr
        assert "this node's zone is unknown" in broken.stderr
        assert node_zone(garbage) == ""  # a worker asking itself goes on too
        preset = _entrypoint_asks({**garbage, "GTS_ZONE": ""})
        assert preset.stdout == "zone=[]\n" and "zone is unknown" not in preset.stderr  # not asked
    finally:
        server.close()
    caplog.clear()
    assert node_zone({"GTS_CLOUD": "aws", "GTS_METADATA_URL": url, "GTS_ZONE": ""}) == ""
    assert "this node's zone is unknown" not in caplog.text  # not asked
