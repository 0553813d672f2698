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
from typing import Any

import pytest

from tests.gpu_health_helpers import INSTANCE, ScalingApi, _fake_tools, _gate, _metadata, _watch_module
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


class Bucket:
    """A stand-in for the run's bucket on 127.0.0.1 (signatures not checked): PutObject, GetObject
    (of a version too) and ListObjectVersions. `versioned`: every PUT adds a version and the
    create-only header is ignored, as OSS and COS do on a bucket that has had versioning on;
    else the header is honoured (412). `fail`: the first requests answer 500, the ones in
    `stored` after keeping the object (a write whose answer was lost)."""

    def __init__(self, versioned: bool, fail: int = 0, stored: int = 0, refuse: int = 0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.versions: dict[str, list[tuple[str, bytes]]] = {}  # key -> [(version id, body)], oldest first
        self.fail, self.stored, self.refuse, self.requests = fail, stored, refuse, 0
        lock, bucket = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def answer(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802
                from urllib.parse import unquote, urlsplit

                key = unquote(urlsplit(self.path).path).split("/", 2)[2]
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    bucket.requests += 1
                    if bucket.refuse:
                        return self.answer(403, b"AccessDenied")
                    held = bucket.versions.setdefault(key, [])
                    failing = bucket.requests <= bucket.fail
                    if failing and bucket.requests > bucket.stored:
                        return self.answer(500)
                    if held and not versioned and self.headers.get("If-None-Match") == "*":
                        return self.answer(412)
                    held.append((f"v{sum(map(len, bucket.versions.values()))}", body))
                self.answer(500 if failing else 200)

            def do_GET(self) -> None:  # noqa: N802
                from urllib.parse import parse_qs, unquote, urlsplit

                url = urlsplit(self.path)
                query = parse_qs(url.query, keep_blank_values=True)
                with lock:
                    if "versions" in query:
                        key = query["prefix"][0]
                        items = "".join(f"<Version><Key>{key}</Key><VersionId>{v}</VersionId></Version>"
                                        for v, _ in reversed(bucket.versions.get(key, [])))  # newest first
                        return self.answer(200, f'<ListVersionsResult xmlns="http://s3.amazonaws.com/doc/'
                                                f'2006-03-01/">{items}</ListVersionsResult>'.encode())
                    held = bucket.versions.get(unquote(url.path).split("/", 2)[2], [])
                    wanted = query.get("versionId", [held[-1][0] if held else ""])[0]
                    found = [b for v, b in held if v == wanted]
                self.answer(200, found[0]) if found else self.answer(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def holders(self) -> dict[str, str]:
        """Each slot's first writer."""
        return {k.rsplit("/", 1)[1]: json.loads(v[0][1])["instance"] for k, v in self.versions.items() if v}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _budget() -> Any:
    return _watch_module().replace_budget


def _env(bucket: Bucket, scheme: str) -> dict[str, str]:
    return {"CHECKPOINT_URL": f"{scheme}://gts-run/{PREFIX}", "STORAGE_ENDPOINT_URL": bucket.url,
            "STORAGE_REGION": "cn-hangzhou", "STORAGE_ADDRESSING_STYLE": "path"}


CREDS = dict(access_key="AK", secret_key="SK", token="", expires=4e9)


@pytest.mark.parametrize("scheme", ["oss", "cosn"])
def test_a_versioned_bucket_that_ignores_create_only_still_gives_each_slot_one_node(scheme: str) -> None:
    budget = _budget()
    bucket = Bucket(versioned=True)
    creds = budget.cloudmeta.Credentials(**CREDS)
    nodes = [f"i-node{i}" for i in range(PER_HOUR + 2)]
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:
            done = list(pool.map(lambda n: budget.take(_env(bucket, scheme), PER_HOUR, n, "gate:gpu_count", creds),
                                 nodes))
    finally:
        bucket.stop()
    won = {n: key.rsplit("/", 1)[1] for n, (ok, key) in zip(nodes, done) if ok}
    assert len(won) == PER_HOUR, done  # every PUT was taken, yet only the first writer of a slot holds it
    assert {slot: n for n, slot in won.items()} == bucket.holders()
    assert all("all 2 replacement slots of the hour" in detail for ok, detail in done if not ok)


def test_a_bucket_failing_twice_then_answering_gives_the_slot_after_backoff() -> None:
    budget = _budget()
    bucket, waited = Bucket(versioned=False, fail=2), list[float]()
    try:
        ok, key = budget.take(_env(bucket, "s3"), PER_HOUR, "i-node0", "xid:79", budget.cloudmeta.Credentials(**CREDS),
                              sleep=waited.append)
    finally:
        bucket.stop()
    assert ok and key.endswith("/slot-0") and bucket.holders() == {"slot-0": "i-node0"}
    assert len(waited) == 2 and waited[0] < waited[1]  # backoff between the attempts


def test_a_write_whose_answer_was_lost_is_recognised_as_this_nodes_slot() -> None:
    budget = _budget()
    bucket, waited = Bucket(versioned=False, fail=1, stored=1), list[float]()  # stored, then 500; the retry finds it: 412
    try:
        ok, key = budget.take(_env(bucket, "s3"), PER_HOUR, "i-node0", "xid:79", budget.cloudmeta.Credentials(**CREDS),
                              sleep=waited.append)
    finally:
        bucket.stop()
    assert ok and key.endswith("/slot-0") and bucket.holders() == {"slot-0": "i-node0"}  # one slot, not two


def test_a_refusal_is_not_retried_and_fails_safe() -> None:
    budget = _budget()
    bucket, waited = Bucket(versioned=False, refuse=1), list[float]()
    try:
        with pytest.raises(budget.Unreachable, match="answered 403 AccessDenied"):
            budget.take(_env(bucket, "s3"), PER_HOUR, "i-node0", "xid:79", budget.cloudmeta.Credentials(**CREDS),
                        sleep=waited.append)
    finally:
        bucket.stop()
    assert waited == [] and bucket.requests == 1


def test_the_node_roles_may_list_and_read_the_versions_on_oss_and_cos() -> None:
    """_first_writer lists a slot's versions and reads the oldest: the roles of the versioned
    buckets' clouds allow both, else every slot there would fail safe."""
    from infra.clouds.alicloud.access import bucket_policy as oss_policy
    from infra.clouds.tencentcloud.access import bucket_policy as cos_policy
    from infra.resolve.access import Grants

    grants = Grants(reads=("datasets/",), writes=(PREFIX,))
    oss = [a for st in json.loads(oss_policy("gts-run", grants))["Statement"] for a in st["Action"]]
    assert {"oss:ListObjectVersions", "oss:GetObjectVersion", "oss:PutObject"} <= set(oss)
    cos = [a for st in json.loads(cos_policy("gts-run", "ap-guangzhou", "125", grants))["statement"] for a in st["action"]]
    assert {"name/cos:GetBucketObjectVersions", "name/cos:GetObject", "name/cos:PutObject"} <= set(cos)


def test_a_node_that_asks_twice_holds_one_slot(tmp_path: Path) -> None:
    """The gate condemns the node and takes a slot; the Xid watch (or a second gate run) asks
    again before the node is gone: the slot it holds, recorded in its run dir, is reused."""
    moto = MotoServer()
    tools = _fake_tools(tmp_path, gpus=7)
    try:
        with _metadata("alicloud", INSTANCE["alicloud"]) as meta:
            api = ScalingApi("alicloud", meta)
            env = _budget_env(moto.url, moto.bucket)
            first, again = [_gate(tmp_path, tools, meta, api, "--gpus", "8", env=env) for _ in range(2)]
            api.stop()
        assert "took replacement slot" in first.stderr
        assert "already holds replacement slot" in again.stderr and "took replacement slot" not in again.stderr
        assert len(moto.keys(PREFIX)) == 1  # one slot of the group's two, not both
    finally:
        moto.stop()
