"""A node's zone for the peer tier's buddies (training/ckpt/peer/ring.py node_zone): GTS_ZONE where
set, else its cloud's metadata service's answer at the documented path (each cloud's
metadata.py ZONE_PATH, served here by the suite's metadata stand-in, IMDSv2's token included),
else none; what the service answers is checked before it names a zone, and an unreachable
service costs the zones, never the run."""

from __future__ import annotations

import pytest

from tests.metadata_server import FakeMetadata
from training import cloudmeta
from training.ckpt.peer.ring import node_zone

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
