"""A node's zone for the peer tier's buddies (training/ckpt/peer/ring.py node_zone): GTS_ZONE where
set, else its cloud's metadata service's answer at the documented path (each cloud's
metadata.py ZONE_PATH, served here by the suite's metadata stand-in, IMDSv2's token included),
else none; what the service answers is checked before it names a zone, and an unreachable
service costs the zones, never the run."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_the_entrypoint_asks_once_and_its_workers_do_not_ask_again(caplog: pytest.LogCaptureFixture) -> None:
    """`python -m training.ckpt.peer.ring` is the entrypoint's one question (it exports the answer as
    GTS_ZONE for its workers); a GTS_ZONE set empty is an answer too, not a reason to ask again."""
    with FakeMetadata("aws") as meta:
        meta.extra[cloudmeta.cloud_metadata("aws").ZONE_PATH] = ZONES["aws"]
        env = {**os.environ, "GTS_CLOUD": "aws", "GTS_METADATA_URL": meta.url}
        env.pop("GTS_ZONE", None)
        asked = subprocess.run([sys.executable, "-m", "training.ckpt.peer.ring"], env=env, capture_output=True,
                               text=True, timeout=60, check=True)
        assert asked.stdout == ZONES["aws"] + "\n"
    unreachable = {"GTS_CLOUD": "aws", "GTS_METADATA_URL": "http://127.0.0.1:9"}
    assert node_zone({**unreachable, "GTS_ZONE": ""}) == ""
    assert "this node's zone is unknown" not in caplog.text  # not asked
    script = (ROOT / "training/node/entrypoint.sh").read_text(encoding="utf-8")
    peer_block = script[script.index('export GTS_PEER_STORE='):script.index("cmd=(python -m training.node.rdzv_launch")]
    assert "GTS_ZONE=${GTS_ZONE-$(python -m training.ckpt.peer.ring)}" in peer_block and "export GTS_ZONE" in peer_block
