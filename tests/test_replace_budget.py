"""The group's replacement budget (training/node/replace_budget.py) with the node's real gate
(cloudinit/scripts/gts-gpu-health.py `gate`, fake GPU tools one GPU short), the budget's slots in
an S3 bucket on 127.0.0.1 (moto) and the group's replace API stood in (ScalingApi, which counts
the requests): N + 2 nodes failing at once ask N times and the other two are quarantined; an
unreachable bucket quarantines (fail safe) and asks nothing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.gpu_health_helpers import INSTANCE, ScalingApi, _fake_tools, _gate, _metadata
from tests.training_helpers import MotoServer, free_port

PER_HOUR = 2
PREFIX = "checkpoints/ali-train/"


def _budget_env(endpoint: str, bucket: str) -> dict[str, str]:
    """node.env's run bucket (the group's checkpoint prefix) and the bound."""
    return {"CHECKPOINT_URL": f"s3://{bucket}/{PREFIX}", "STORAGE_ENDPOINT_URL": endpoint,
            "STORAGE_REGION": "us-east-1", "STORAGE_ADDRESSING_STYLE": "path",
            "GTS_REPLACEMENTS_PER_HOUR": str(PER_HOUR)}


def _replace_calls(api: ScalingApi) -> list[dict[str, object]]:
    return [c for c in api.calls if c.get("action") != "GetObject"]


def test_n_plus_two_nodes_failing_at_once_ask_for_n_replacements(tmp_path: Path) -> None:
    moto = MotoServer()
    tools = _fake_tools(tmp_path, gpus=7)
    nodes = [tmp_path / f"node{i}" for i in range(PER_HOUR + 2)]
    try:
        with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
            api = ScalingApi("alicloud", meta)
            env = _budget_env(moto.url, moto.bucket)
            with ThreadPoolExecutor(len(nodes)) as pool:
                done = list(pool.map(lambda tmp: _gate(tmp, tools, meta, api, "--gpus", "8", env=env), nodes))
            api.stop()
        assert [d.returncode for d in done] == [1] * len(nodes)
        assert len(_replace_calls(api)) == PER_HOUR, api.calls
        spent = [d for d in done if "replacement budget spent for group ali-train (2 an hour" in d.stderr]
        assert len(spent) == 2, [d.stderr[-600:] for d in done]
        taken = [d for d in done if "took replacement slot" in d.stderr]
        assert len(taken) == PER_HOUR
        for node in nodes:  # each node is out of the run, and the quarantined say so in a metric
            assert (node / "run" / "spot-notice").exists()
        quarantined = [n for n in nodes if 'why="replace_budget_spent"' in (n / "tf" / "gts_gpu_gate.prom").read_text()]
        assert len(quarantined) == 2
        slots = [k for k in moto.keys(PREFIX) if re.fullmatch(rf"{PREFIX}replacements/\d{{10}}/slot-[01]", k)]
        assert len(slots) == PER_HOUR and len(moto.keys(PREFIX)) == PER_HOUR
        body = json.loads(moto.client().get_object(Bucket=moto.bucket, Key=slots[0])["Body"].read())
        assert body["instance"] == INSTANCE["alicloud"] and body["reason"] == "gate:gpu_count"
    finally:
        moto.stop()


def test_an_unreachable_budget_quarantines_and_asks_nothing(tmp_path: Path) -> None:
    tools = _fake_tools(tmp_path, gpus=7)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
        api = ScalingApi("alicloud", meta)
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", env=_budget_env(closed, "gts-test"))
        api.stop()
    assert done.returncode == 1
    assert not _replace_calls(api)
    [line] = [x for x in done.stderr.splitlines() if "replacement budget could not be read" in x]
    assert "this node is NOT replaced (fail safe)" in line and "127.0.0.1" in line
    metrics = (tmp_path / "tf" / "gts_gpu_gate.prom").read_text()
    assert 'gts_gpu_quarantined{cloud="alicloud",group="ali-train",why="replace_budget_unreachable"} 1' in metrics


def test_a_node_without_a_run_bucket_is_quarantined_and_a_bad_setting_falls_back_to_the_default(
        tmp_path: Path) -> None:
    """A typo in GTS_REPLACEMENTS_PER_HOUR must not stop every node of the group (a usage error
    exits before the gate and the watch run): the line names it and the default bound applies."""
    tools = _fake_tools(tmp_path, gpus=7)
    with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
        api = ScalingApi("alicloud", meta)
        done = _gate(tmp_path, tools, meta, api, "--gpus", "8", env={"GTS_REPLACEMENTS_PER_HOUR": "2"})
        bad = [_gate(tmp_path, tools, meta, api, "--gpus", "8", env={"GTS_REPLACEMENTS_PER_HOUR": value})
               for value in ("-1", "three")]
        api.stop()
    assert done.returncode == 1 and not _replace_calls(api)
    assert "the node has no run bucket to keep the budget in" in done.stderr
    for value, run in zip(("-1", "three"), bad):
        assert run.returncode == 1 and "Traceback" not in run.stderr  # the gate ran and judged the node
        [line] = [x for x in run.stderr.splitlines() if "GTS_REPLACEMENTS_PER_HOUR" in x]
        assert f"{value!r} is not a whole number of 0 (no bound) or more" in line
        assert "the default applies: 3 an hour" in line
        assert "the node has no run bucket to keep the budget in" in run.stderr  # bounded, not unbounded
