"""A move that goes wrong, and two watches at once (infra/capacity/broker.py): a failed `up` sets
the config back, records the attempt and stops the watch with one line (exit 1); a stack whose
outputs show the group's fleet on another cloud than its activeCandidate is said so and not
moved; a second watch of the stack finds the first one's lock in the bucket and moves nothing.
The clouds are tests/test_capacity_broker.py's World (moto's server, recorded answers)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import boto3
import pytest

from infra.buckets import bucket
from infra.capacity.__main__ import _watch
from infra.capacity.broker import LOCK, STALE_AFTER_S, Broker, Busy, Decision, MoveFailed
from infra.capacity.transfer import copy_step, progress
from infra.capacity.workspace import RecordingWorkspace, uncommitted
from infra.checks.validation import parse_stack
from tests.harness import key, spec_raw, stack_values
from tests.capacity_helpers import recorded
from tests.test_capacity_broker import World, _values
from tests.training_helpers import MotoServer, storage_env
from training.ckpt.lease import Lease
from training.ckpt.storage import location

ACTIVE = "gpu-training-stack:nodeGroups[0].activeCandidate"


class FailingUp(RecordingWorkspace):
    def up(self, message: str, pack_config: dict[str, object]) -> None:
        super().up(message, pack_config)
        raise RuntimeError("code: 255\n stderr: error: update failed: creating Auto Scaling group: quota exceeded")


def _buckets(moto: MotoServer) -> tuple[str, str]:
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    names = bucket(spec, "aws").name, bucket(spec, "tencentcloud").name
    for name in names:
        moto.client().create_bucket(Bucket=name)
    return names


def test_a_failed_up_sets_the_config_back_records_it_and_exits_1(moto: MotoServer, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    _, tc = _buckets(moto)
    before = moto.keys_in(tc, "records/capacity/aws-train/")
    workspace = FailingUp(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    broker = Broker(workspace, world.stock, storage=lambda where, url: location(url, env))
    assert _watch(broker) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("error: aws-train: `up` to tencentcloud ap-guangzhou GN7.2XLARGE32 spot failed (")
    assert "activeCandidate set back to 0" in out.err
    assert workspace.changes == [(ACTIVE, "3"), (ACTIVE, "0")]
    assert json.loads(workspace.values[key("nodeGroups")])[0]["activeCandidate"] == 0
    (record,) = [k for k in moto.keys_in(tc, "records/capacity/aws-train/") if k not in before]
    body = json.loads(moto.client().get_object(Bucket=tc, Key=record)["Body"].read())
    assert (body["from"], body["to"]) == (0, 3) and "quota exceeded" in body["failed"]
    again = World(moto, monkeypatch)
    with pytest.raises(MoveFailed):  # and the broker itself raises, never a half-done decision
        Broker(FailingUp(_values(), {"aws": {"fleets": {"aws-train": [again.asg]}}}), again.stock,
               storage=lambda where, url: location(url, env)).once()


def test_outputs_elsewhere_than_the_active_place_are_said_and_not_moved(moto: MotoServer,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    _buckets(moto)
    values = _values()
    groups = json.loads(values[key("nodeGroups")])
    groups[0]["activeCandidate"] = 3  # the config says Tencent; the outputs still show the AWS group
    values[key("nodeGroups")] = json.dumps(groups)
    workspace = RecordingWorkspace(values, {"aws": {"fleets": {"aws-train": [world.asg]}},
                                            "tencentcloud": {"fleets": {}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    assert decision.action == "mismatch" and "outputs show its fleet on aws" in decision.reason
    assert workspace.changes == [] and world.aws.calls == [] and not world.tc.asked


def test_a_second_watch_finds_the_lock_and_moves_nothing(moto: MotoServer, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    aws, _ = _buckets(moto)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    other = Lease(location(f"{bucket(spec, 'aws').url}{LOCK}", env), "capacity broker on another runner")
    other.acquire()
    try:
        workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
        broker = Broker(workspace, world.stock, storage=lambda where, url: location(url, env))
        with pytest.raises(Busy, match="another capacity watch of this stack is running"):
            broker.once()
        assert _watch(broker) == 0 and capsys.readouterr().out.startswith("skipped: another capacity watch")
        assert workspace.changes == [] and workspace.ups == [] and world.aws.calls == []
    finally:
        other.release()
    assert moto.keys_in(aws, LOCK) == []


def test_a_half_written_step_nobody_writes_any_more_does_not_block_a_move(
        moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    aws, _ = _buckets(moto)
    partial = "checkpoints/aws-train/step-00000090/model.pt"
    moto.client().put_object(Bucket=aws, Key=partial, Body=b"x")
    later = datetime.now(timezone.utc) + timedelta(seconds=STALE_AFTER_S + 60)
    try:
        workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
        (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env),
                             now=lambda: later).once()
    finally:
        moto.client().delete_object(Bucket=aws, Key=partial)
    assert (decision.action, decision.at) == ("move", 3), decision
    assert "step(s) 90 abandoned half-written" in decision.reason
    # no node of the group running: abandoned at once, however fresh (file://, the same reader)
    loc = location(f"file://{tmp_path}/ckpt")
    loc.fs.pipe(f"{tmp_path}/ckpt/step-00000010/model.pt", b"x")
    assert progress(loc, datetime.now(timezone.utc), STALE_AFTER_S).writing == 10
    assert progress(loc, datetime.now(timezone.utc), STALE_AFTER_S, writers=False).abandoned == [10]


def test_the_command_refuses_a_stale_after_under_the_trainers_upload_deadline(
        capsys: pytest.CaptureFixture[str]) -> None:
    from infra.capacity.__main__ import main

    assert main(["watch", "--stack", "dev", "--stale-after", "5"]) == 2
    assert capsys.readouterr().err == ("error: --stale-after 5: at least the trainer's --upload-deadline-s default "
                                       "(90 s), above the longest one-file upload\n")


def test_one_candidates_api_error_skips_it_and_the_next_is_asked(moto: MotoServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    _buckets(moto)

    def down(request: urllib.request.Request, timeout: float) -> dict[str, object]:
        raise urllib.error.URLError("[Errno 111] Connection refused")

    world.ali = down  # type: ignore[assignment]
    workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    assert (decision.action, decision.at) == ("move", 3), decision
    assert decision.skipped[1] == {"index": 2, "place": "alicloud cn-hangzhou ecs.gn6i-c4g1.xlarge spot", "calls": None,
                                   "why": "its API failed: URLError: <urlopen error [Errno 111] Connection refused>"}


def test_a_reservation_candidate_outside_its_window_is_skipped_without_a_call(
        moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    _buckets(moto)
    values = _values()
    groups = json.loads(values[key("nodeGroups")])
    groups[0]["capacity"][0]["market"] = {"type": "capacity-block", "start": "2026-12-20T08:00:00Z",
                                          "end": "2026-12-24T08:00:00Z", "reservationId": "cr-0123456789abcdef0"}
    values[key("nodeGroups")] = json.dumps(groups)
    workspace = RecordingWorkspace(values, {"aws": {"fleets": {"aws-train": [world.asg]}}})
    at = datetime(2026, 12, 2, tzinfo=timezone.utc)
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env), now=lambda: at).once()
    assert (decision.action, decision.at) == ("move", 3), decision
    assert decision.skipped[0] == {"index": 1, "place": "aws us-east-1 g5.xlarge capacity-block", "calls": 0,
                                   "why": "its capacity-block window 2026-12-20T08:00:00+00:00 to "
                                          "2026-12-24T08:00:00+00:00 (less 1800 s notice) is not open now"}
    assert world.aws.calls == ["DescribeScalingActivities", "DescribeAutoScalingGroups"]  # g5 never asked


def test_it_moves_back_only_after_a_step_is_committed_where_it_arrived(
        reference: tuple[str, Path], moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    _, ck = reference  # a real run's committed steps 20, 40, 60
    env = storage_env(moto.url)
    # the declared place is the AWS group's one zone (multi-node training), us-east-1a: its score is asked
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto.url, aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    zone_a = ec2.describe_availability_zones(ZoneNames=["us-east-1a"])["AvailabilityZones"][0]["ZoneId"]
    high = recorded("aws", "spot_placement_scores_high", **{"us-west-2": "us-east-1", "usw2-az1": zone_a})
    world = World(moto, monkeypatch, score=high)
    _, tc = _buckets(moto)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    there = location(bucket(spec, "tencentcloud").checkpoint_url("aws-train"), env)
    copy_step(location(f"file://{ck}"), there, 20)
    for old in moto.keys_in(tc, "records/capacity/aws-train/"):  # the other tests' moves: this one arrived last
        moto.client().delete_object(Bucket=tc, Key=old)
    arrival = {"at": "2026-12-02T00:00:00+00:00", "group": "aws-train", "from": 0, "to": 3, "failed": "", "step": 20}
    moto.client().put_object(Bucket=tc, Key="records/capacity/aws-train/20261202T000000000000Z.json",
                             Body=json.dumps(arrival).encode())
    values = _values("spot")  # declared spot: a placement score is a stock answer
    groups = json.loads(values[key("nodeGroups")])
    groups[0]["activeCandidate"] = 3
    values[key("nodeGroups")] = json.dumps(groups)
    quiet = {"Response": {"RequestId": "r", "TotalCount": 0, "ActivitySet": []}}

    def watch() -> tuple[RecordingWorkspace, Decision]:
        world.tc.answers["DescribeAutoScalingActivities"] = [quiet]
        workspace = RecordingWorkspace(dict(values), {"tencentcloud": {"fleets": {"aws-train": ["asg-kiju7yt5"]}}})
        (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env),
                             move_back=True).once()
        return workspace, decision

    workspace, decision = watch()  # only the step it arrived with: its nodes may still be starting
    assert (decision.action, decision.at) == ("stay", 3) and "no step committed" in decision.reason, decision
    assert workspace.changes == [] and world.aws.calls == []
    copy_step(location(f"file://{ck}"), there, 40)  # the run made progress there
    workspace, decision = watch()
    assert (decision.action, decision.at) == ("move", 0), decision
    assert world.aws.calls == ["DescribeInstanceTypeOfferings", "GetServiceQuota", "DescribeAvailabilityZones",
                               "GetSpotPlacementScores"]
    assert decision.copied is not None and decision.copied.step == 40


def test_the_broker_runs_only_on_the_committed_stack_file(tmp_path: Path) -> None:
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=tmp_path,
                       check=True, capture_output=True)
    git("init", "-q")
    stack_file = tmp_path / "Pulumi.prod.yaml"
    stack_file.write_text("config: {}\n")
    assert uncommitted(tmp_path, "prod") == f"Pulumi.prod.yaml is not committed in {tmp_path}: commit it first"
    git("add", "Pulumi.prod.yaml")
    git("commit", "-q", "-m", "stack")
    assert uncommitted(tmp_path, "prod") == ""
    stack_file.write_text("config: {gpu-training-stack:env: prod}\n")
    assert uncommitted(tmp_path, "prod") == ("Pulumi.prod.yaml differs from the committed one: commit (or discard) "
                                             "the change first")
