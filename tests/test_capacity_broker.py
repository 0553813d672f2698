"""The capacity broker end to end, offline: a group on AWS whose Auto Scaling group reports
InsufficientInstanceCapacity (moto's ASG, the activity a recorded answer: moto records none);
its candidates are asked in order — another AWS type (a low spot placement score), Alibaba
(sold out), Tencent (in stock) — each in a few calls; the group is moved through the stack's
config (a recording workspace: no Pulumi CLI here), the newest committed checkpoint is copied
from the AWS bucket to the Tencent one (both on a moto server, s3:// and cosn://) and verified,
and the trainer resumes there bit-exact."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from infra.buckets import bucket
from infra.capacity.broker import Broker
from infra.capacity.stock import StockApi, stock_api
from infra.capacity.workspace import RecordingWorkspace
from infra.checks.validation import parse_stack
from tests.capacity_helpers import AwsCalls, Replay, recorded
from tests.conftest import TRAIN_ARGS as ARGS
from tests.harness import key, spec_raw, stack_values
from tests.training_helpers import MotoServer, launch, storage_env
from training import cloudmeta
from training.ckpt.storage import location

# spot capped at $0.90 per node-hour on the other clouds: the pack judges a spot place at its cap (or at
# on-demand without one), and Tencent's GN7 on-demand is over 1.5 x the declared g4dn on-demand
CANDIDATES = [{"types": ["g5.xlarge"], "market": {"type": "spot"}},
              {"cloud": "alicloud", "types": ["ecs.gn6i-c4g1.xlarge"], "market": {"type": "spot", "spotMaxPriceUsd": 0.9}},
              {"cloud": "tencentcloud", "types": ["GN7.2XLARGE32"], "market": {"type": "spot", "spotMaxPriceUsd": 0.9}}]
CREDS = cloudmeta.Credentials("AKIDEXAMPLE", "secret-example", "", 0.0)


def _values(market: str = "on-demand") -> dict[str, str]:
    """The dev stack with the AWS group's candidates; declared on-demand, the spot candidates are
    within the policy pack's cap (1.5 x its $/h), declared spot they are not."""
    config = stack_values("dev")
    config[key("nodeGroups")][0]["capacity"] = CANDIDATES
    config[key("nodeGroups")][0]["market"] = {"type": market}
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


class World:
    """The clouds as the broker sees them: AWS on the moto server, Alibaba and Tencent replayed."""

    def __init__(self, moto: MotoServer, monkeypatch: pytest.MonkeyPatch, short: bool = True,
                 activities: str = "scaling_activities_insufficient", score: str | dict[str, object] = "spot_placement_scores_low"):
        for name, value in storage_env(moto.url).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)  # boto3's own setting: every client to the moto server
        self.aws = AwsCalls("us-east-1")
        self.asg = self._asg(short)
        self.aws.answer(self.aws.autoscaling, "DescribeScalingActivities", recorded("aws", activities, GROUP=self.asg))
        self.aws.answer(self.aws.quotas, "GetServiceQuota", recorded("aws", "service_quota_g_spot"))
        self.aws.answer(self.aws.ec2, "GetSpotPlacementScores", recorded("aws", score) if isinstance(score, str)
                        else score)
        self.ali = Replay({"DescribeAvailableResource": [recorded("alicloud", "available_resource_sold_out",
                                                                  **{"ecs.gn7i-c8g1.2xlarge": "ecs.gn6i-c4g1.xlarge"})]})
        self.tc = Replay({"DescribeZoneInstanceConfigInfos": [recorded("tencentcloud", "zone_config_in_stock")],
                          "DescribeAccountQuota": [recorded("tencentcloud", "account_quota_spot")]})

    made = 0

    def _asg(self, short: bool) -> str:
        """moto's group of two nodes, both in service (moto launches whatever is desired); a short one
        is a recorded answer: one of its two nodes in service (a launch that found no capacity)."""
        World.made += 1  # one moto server per module: each world its own group
        name = f"gts-dev-aws-train-{World.made}"
        ec2 = self.aws.ec2
        subnet = ec2.create_subnet(VpcId=ec2.create_vpc(CidrBlock="10.10.0.0/16")["Vpc"]["VpcId"],
                                   CidrBlock="10.10.0.0/20", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
        ec2.create_launch_template(LaunchTemplateName=name,
                                   LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "g4dn.2xlarge"})
        self.aws.autoscaling.create_auto_scaling_group(
            AutoScalingGroupName=name, MinSize=0, MaxSize=2, DesiredCapacity=2,
            LaunchTemplate={"LaunchTemplateName": name}, VPCZoneIdentifier=subnet)
        (found,) = self.aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"]
        assert [i["LifecycleState"] for i in found["Instances"]] == ["InService", "InService"]
        if short:
            self.aws.answer(self.aws.autoscaling, "DescribeAutoScalingGroups",
                            recorded("aws", "auto_scaling_groups_short", GROUP=name))
        self.aws.calls.clear()
        return name

    def stock(self, cloud: str, region: str) -> StockApi:
        if cloud == "aws":
            return stock_api(cloud, region, ec2=self.aws.ec2, autoscaling=self.aws.autoscaling, quotas=self.aws.quotas)
        return stock_api(cloud, region, creds=CREDS, send=self.ali if cloud == "alicloud" else self.tc)


def test_insufficient_capacity_moves_the_group_and_the_run_resumes_bit_exact_elsewhere(
        reference: tuple[str, Path], moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest, _ = reference
    world = World(moto, monkeypatch)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    aws_bucket, tc_bucket = bucket(spec, "aws"), bucket(spec, "tencentcloud")
    for b in (aws_bucket, tc_bucket):
        moto.client().create_bucket(Bucket=b.name)
    env = storage_env(moto.url)
    # The run on AWS, stopped as a reclaim would: its emergency checkpoint goes up.
    (tmp_path / "aws-node").mkdir()
    first = launch([*ARGS, "--checkpoint-dir", aws_bucket.checkpoint_url("aws-train"), "--throttle-ms", "100"],
                   tmp_path / "aws-node", env)
    first.wait_for(r"uploaded step-00000020 ")
    os.kill(first.proc.pid, signal.SIGTERM)
    first.finish()
    stopped = int(first.wait_for(r"stopped by SIGTERM at step \d+").split("at step ")[1].split()[0])
    first.wait_for(rf"uploaded step-{stopped:08d} ")

    workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()

    assert (decision.action, decision.at) == ("move", 3), decision
    # each rejected candidate in a few calls: AWS g5 (offerings, quota, score), Alibaba (one type), and the
    # one read of the group's activities
    assert [(s["index"], s["calls"]) for s in decision.skipped] == [(1, 3), (2, 1)]
    assert world.aws.calls == ["DescribeScalingActivities", "DescribeAutoScalingGroups",
                               "DescribeInstanceTypeOfferings", "GetServiceQuota", "GetSpotPlacementScores"]
    assert [a[0] for a in world.ali.asked] == ["DescribeAvailableResource"]
    assert [a[0] for a in world.tc.asked] == ["DescribeZoneInstanceConfigInfos", "DescribeAccountQuota"]
    assert workspace.changes == [("gpu-training-stack:nodeGroups[0].activeCandidate", "3")]
    assert workspace.ups == ["capacity broker: aws-train to tencentcloud ap-guangzhou GN7.2XLARGE32 spot"]
    # `up` judged by the whole pack, with the pack config of the stack as moved (the group priced at Tencent)
    (pack,) = workspace.packs
    assert list(pack["stack-cost-cap"]["groupPrices"]["aws-train"]) == ["GN7.2XLARGE32"]
    assert pack["gpu-spot-only"] == "mandatory" and "capacityPlaces" in pack["capacity-candidates-capped"]
    assert decision.copied is not None and decision.copied.step == stopped and decision.copied.files == 3
    # The stack as changed: the group is declared on Tencent now, its checkpoints in the Tencent bucket.
    moved = parse_stack(spec_raw({k: json.loads(v) if k.endswith(("nodeGroups",)) else v
                                  for k, v in workspace.values.items()})).group("aws-train")
    assert moved.cloud == "tencentcloud" and moved.trainer["CHECKPOINT_URL"] == tc_bucket.checkpoint_url("aws-train")
    records = moto.keys_in(tc_bucket.name, "records/capacity/aws-train/")
    assert len(records) == 1
    record = json.loads(moto.client().get_object(Bucket=tc_bucket.name, Key=records[0])["Body"].read())
    assert (record["from"], record["to"], record["copied"]["step"]) == (0, 3, stopped)

    # A new node on Tencent: no local disk, the copied checkpoint only.
    (tmp_path / "tc-node").mkdir()
    again = launch([*ARGS, "--checkpoint-dir", tc_bucket.checkpoint_url("aws-train")], tmp_path / "tc-node", env)
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(rf"fetched step-{stopped:08d} from cosn://")
    assert again.final()[2] == digest


def test_no_failure_stays_and_a_checkpoint_being_written_waits(moto: MotoServer, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    aws_bucket = bucket(spec, "aws")
    moto.client().create_bucket(Bucket=aws_bucket.name)
    workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": []}}})  # no group id: no failures read
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    assert (decision.action, decision.at) == ("stay", 0) and world.aws.calls == []
    partial = "checkpoints/aws-train/step-00000080/model.pt"
    moto.client().put_object(Bucket=aws_bucket.name, Key=partial, Body=b"x")
    workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    try:
        (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    finally:
        moto.client().delete_object(Bucket=aws_bucket.name, Key=partial)
    assert decision.action == "wait" and "step 80 is being written" in decision.reason
    assert workspace.changes == [] and world.aws.calls == ["DescribeScalingActivities", "DescribeAutoScalingGroups"]


def test_a_candidate_over_the_packs_cap_is_never_asked_nor_moved_to(moto: MotoServer, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    moto.client().create_bucket(Bucket=bucket(parse_stack(spec_raw(stack_values("dev"))).spec, "aws").name)
    workspace = RecordingWorkspace(_values("spot"), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    assert (decision.action, decision.at) == ("stay", 0)
    assert [(s["index"], s["calls"]) for s in decision.skipped] == [(1, 0), (2, 0), (3, 0)]
    assert all(str(s["why"]).startswith("refused by the policy pack: ") for s in decision.skipped)
    assert "over 1.5 x the declared place's $0.45/h" in str(decision.skipped[2]["why"])
    assert world.aws.calls == ["DescribeScalingActivities", "DescribeAutoScalingGroups"]
    assert not world.ali.asked and not world.tc.asked
    assert workspace.changes == [] and workspace.ups == []


@pytest.mark.parametrize(("short", "activities", "why"), [
    (False, "scaling_activities_insufficient", "the group has all its nodes in service"),
    (True, "scaling_activities_recovered", "a launch succeeded after the failure"),
])
def test_a_healthy_group_is_not_moved_for_an_old_failure(moto: MotoServer, monkeypatch: pytest.MonkeyPatch,
                                                         short: bool, activities: str, why: str) -> None:
    world = World(moto, monkeypatch, short=short, activities=activities)
    env = storage_env(moto.url)
    moto.client().create_bucket(Bucket=bucket(parse_stack(spec_raw(stack_values("dev"))).spec, "aws").name)
    workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env)).once()
    assert (decision.action, decision.at) == ("stay", 0), why
    assert workspace.changes == [] and "DescribeInstanceTypeOfferings" not in world.aws.calls, why


@pytest.mark.parametrize(("args", "line"), [
    (["watch", "--stack", "dev; rm -rf /"], "error: --stack 'dev; rm -rf /' is not a stack name (letters, digits, . _ -)"),
    (["watch", "--stack", "dev", "--every", "1"], "error: --every 1: watch at most every 10 seconds (the clouds' API "
                                                  "rate limits)"),
    (["watch", "--stack", "dev", "--once"], "error: the Pulumi CLI is not installed: the Automation API drives it "
                                            "(pulumi.com/docs/install)"),
])
def test_the_command_refuses_bad_input_in_one_line(args: list[str], line: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.harness import ROOT

    env = {**os.environ, "PATH": str(tmp_path)}  # no pulumi binary on the path, as on this machine
    out = subprocess.run([sys.executable, "-m", "infra.capacity", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")


def test_it_moves_back_only_when_asked_and_the_declared_place_has_stock(moto: MotoServer,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(moto, monkeypatch)
    env = storage_env(moto.url)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    for b in (bucket(spec, "aws"), bucket(spec, "tencentcloud")):
        moto.client().create_bucket(Bucket=b.name)
    values = _values()
    groups = json.loads(values[key("nodeGroups")])
    groups[0]["activeCandidate"] = 3  # on Tencent now
    values[key("nodeGroups")] = json.dumps(groups)
    outputs = {"tencentcloud": {"fleets": {"aws-train": ["asg-kiju7yt5"]}}}
    quiet = {"Response": {"RequestId": "r", "TotalCount": 0, "ActivitySet": []}}
    for move_back, expected in ((False, ("stay", 3)), (True, ("stay", 3))):
        world.tc.answers["DescribeAutoScalingActivities"] = [quiet]
        world.aws.calls.clear()
        workspace = RecordingWorkspace(dict(values), outputs)
        (decision,) = Broker(workspace, world.stock, storage=lambda where, url: location(url, env),
                             move_back=move_back).once()
        assert (decision.action, decision.at) == expected, decision
    # the declared place (on-demand) asked in two calls: offered there, and the on-demand quota; EC2 has no
    # on-demand stock answer, so it is not moved back on a guess (tests/test_capacity_move.py: a spot one is)
    assert world.aws.calls == ["DescribeInstanceTypeOfferings", "GetServiceQuota"]
    assert str(decision.skipped[0]["why"]).endswith("(on-demand stock unknown): stock unknown, not moved back on a guess")
    assert workspace.changes == []


class _Hung:
    """A stock API that never answers until released (an endpoint that accepts and says nothing)."""

    def __init__(self) -> None:
        self.release, self.asked = threading.Event(), threading.Event()

    def ask(self, ask: object) -> None:
        self.asked.set()
        self.release.wait(60)  # a broker without its budget would be stuck here: 60 s, then an answer it cannot read


def test_a_place_whose_api_does_not_answer_within_the_budget_is_skipped_and_the_next_one_asked(
        moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    world, hung = World(moto, monkeypatch), _Hung()
    env = storage_env(moto.url)
    spec = parse_stack(spec_raw(stack_values("dev"))).spec
    for cloud in ("aws", "tencentcloud"):
        moto.client().create_bucket(Bucket=bucket(spec, cloud).name)
    workspace = RecordingWorkspace(_values(), {"aws": {"fleets": {"aws-train": [world.asg]}}})
    def stock(cloud: str, region: str) -> StockApi:
        return hung if cloud == "alicloud" else world.stock(cloud, region)  # type: ignore[return-value]

    try:
        (decision,) = Broker(workspace, stock, storage=lambda where, url: location(url, env), ask_budget_s=2.0).once()
    finally:
        hung.release.set()
    assert hung.asked.is_set()
    assert (decision.action, decision.at) == ("move", 3), decision
    (skipped_ali,) = [s for s in decision.skipped if s["index"] == 2]
    assert skipped_ali["why"] == "its API failed: NoAnswer: no answer within 2 s"


def test_the_budget_per_place_is_five_seconds_and_each_clouds_client_gives_up_inside_it() -> None:
    from infra.capacity import stock as stock_module
    from infra.clouds.alicloud import stock as ali
    from infra.clouds.aws import stock as aws
    from infra.clouds.tencentcloud import stock as tc

    assert stock_module.ASK_BUDGET_S == 5.0
    assert all(m.TIMEOUT_S < stock_module.ASK_BUDGET_S for m in (ali, aws, tc))
    api = aws.open_api("us-east-1")
    config = api.ec2.meta.config
    assert (config.read_timeout, config.connect_timeout) == (aws.TIMEOUT_S, aws.TIMEOUT_S / 2)
    assert config.retries == {"mode": "standard", "total_max_attempts": 2}
