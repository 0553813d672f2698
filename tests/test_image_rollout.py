"""Issue 41: a new trainer image reaches a node whose user data is never read again (a fixed
instance: Tencent's tc-train-<i> and HCC nodes, Alibaba's reserved nodes; cloud-init runs once per
instance). The plan writes each VM group's current image to nodes/images/<group>; the trainer unit
runs what gts-image.py reads there with the instance role, else its user data's image."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT
from tests.metadata_server import FakeMetadata
from tests.training_helpers import MotoServer

OBJECT_TYPES = ("aws:s3/bucketObject:BucketObject", "alicloud:oss/bucketObject:BucketObject",
                "tencentcloud:Cos/bucketObject:BucketObject")
NODE_STARTERS = {"aws:ec2/launchTemplate:LaunchTemplate": "userData",
                 "alicloud:ecs/ecsLaunchTemplate:EcsLaunchTemplate": "userData",
                 "alicloud:ess/scalingConfiguration:ScalingConfiguration": "userData",
                 "alicloud:ecs/instance:Instance": "userData",
                 "tencentcloud:As/scalingConfig:ScalingConfig": "userData",
                 "tencentcloud:Instance/instance:Instance": "userData"}


def test_every_vm_groups_current_image_is_where_its_nodes_read_it(tmp_path: Path) -> None:
    from infra.buckets import image_key
    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped
    from tests.nodes import lay_down, node_env

    for stack in ("dev", "prod"):
        resources = list(shipped(stack))
        objects = {unwrap_secrets(r.inputs)["key"]: unwrap_secrets(r.inputs)["content"] for r in resources
                   if r.type in OBJECT_TYPES}
        seen = 0
        for r in resources:
            field = NODE_STARTERS.get(r.type)
            data = unwrap_secrets(r.inputs).get(field or "")
            if not field or not isinstance(data, str) or "-rdzv-" in r.name:
                continue
            root = tmp_path / stack / r.name
            lay_down(base64.b64decode(data), root)
            env = node_env(root)
            if env["GTS_MODE"] != "vm":
                continue  # a cluster's node runs no trainer of its own
            assert objects.get(image_key(env["GTS_NODE_GROUP"])) == env["GTS_IMAGE"], (stack, r.name)
            seen += 1
        assert seen >= 3, (stack, seen)


def test_the_node_script_reads_the_same_key_as_the_plan_writes() -> None:
    from infra.buckets import image_key

    spec = __import__("importlib.util").util.spec_from_file_location("gts_image", ROOT / "cloudinit/scripts/gts-image.py")
    module = __import__("importlib.util").util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "training"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "training"))
    assert module.image_key("tc-train") == image_key("tc-train")


@pytest.mark.parametrize("cloud", ["aws", "alicloud", "tencentcloud"])
def test_a_node_runs_its_groups_current_image_else_its_own(tmp_path: Path, cloud: str) -> None:
    bucket, group = "gts-prod-bucket", f"{cloud}-train"
    first = "registry.example/gts/prod-trainer@sha256:" + "1" * 64
    later = "registry.example/gts/prod-trainer@sha256:" + "2" * 64
    server = MotoServer(bucket=bucket)
    try:
        with FakeMetadata(cloud) as meta:
            env_file = tmp_path / "node.env"
            env_file.write_text(f"GTS_CLOUD={cloud}\nGTS_NODE_GROUP={group}\nGTS_IMAGE={first}\n"
                                f"GTS_BUNDLE_URL=s3://{bucket}/nodes/bundle-x.tar.gz.b64\nGTS_METADATA_URL={meta.url}\n"
                                f"STORAGE_ENDPOINT_URL={server.url}\nSTORAGE_REGION=us-east-1\n"
                                "STORAGE_ADDRESSING_STYLE=path\n")

            def image() -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, str(ROOT / "cloudinit/scripts/gts-image.py"), "--env",
                                       str(env_file)], env={"GTS_LIB": str(ROOT / "training"), "PATH": "/usr/bin:/bin"},
                                      capture_output=True, text=True, timeout=60)

            got = image()
            assert got.returncode == 0 and got.stdout.strip() == first, got.stderr  # nothing published: its own
            server.client().put_object(Bucket=bucket, Key=f"nodes/images/{group}", Body=later.encode())
            got = image()
            assert got.returncode == 0 and got.stdout.strip() == later, got.stderr
            server.client().put_object(Bucket=bucket, Key=f"nodes/images/{group}", Body=b"x; rm -rf / #")
            got = image()
            assert got.returncode != 0 and not got.stdout.strip() and f"nodes/images/{group}" in got.stderr, got
    finally:
        server.stop()
