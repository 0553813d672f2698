"""Prices per region: `make prices` on recorded responses of the clouds' own price sources
(tests/data/prices/, each API's documented format), every figure at the group's region (plan,
node env, policy pack), the error for a type unpriced in its region, and the prices' age."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.core import catalog as cat
from infra.prices import age, refresh
from infra.prices.sources import PriceSourceError, alicloud_price, alicloud_spot, aws_offer, aws_spot, tencentcloud_price
from infra.resolve.groups import resolve
from infra.stack import policy_config
from infra.stack.stackfile import load_stack_spec
from policies.gts_policy.resources import Res
from policies.gts_policy.rules_cost import group_cost_cap
from tests.harness import ROOT, project_copy, stack_values, write_stack

RECORDED = ROOT / "tests" / "data" / "prices"


def prices_copy(tmp: Path) -> Path:
    path = tmp / "prices.csv"
    shutil.copy(cat.DATA_DIR / "prices.csv", path)
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.prices.refresh", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def figures(path: Path) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    _, rows = refresh.read(path)
    return {(p.cloud, p.instance_type, p.region): (p.on_demand, p.currency, p.spot_discount, p.spot_band,
                                                   p.reserved_discount) for p in rows}


# ------------------------------------------------------------------------ the sources

def test_the_offer_filter_takes_plain_linux_on_demand_only() -> None:
    lines = (RECORDED / "aws" / "offer-us-east-1.csv").read_text().splitlines()
    offer = aws_offer(lines, "us-east-1", {"p4d.24xlarge", "p5.48xlarge", "g4dn.xlarge", "g6.xlarge", "p3.2xlarge"})
    # Windows, Dedicated, Reserved and p5's Capacity Block at $0.00 are in the file and all refused
    assert offer.prices == {"p4d.24xlarge": 21.957642, "p5.48xlarge": 55.04, "g4dn.xlarge": 0.526, "g6.xlarge": 0.8048}
    assert (offer.version, offer.date) == ("20260910195514", "2026-09-10")
    # the same product's 1-year, no-upfront, standard Reserved term: what reserved_discount stands for
    assert offer.reserved["p4d.24xlarge"] == pytest.approx(21.957642 * 0.6, abs=1e-4)
    with pytest.raises(PriceSourceError, match="Publication Date"):
        aws_offer(lines[5:], "us-east-1", {"p4d.24xlarge"})


def test_spot_advisor_alibaba_and_tencent_formats() -> None:
    advisor = json.loads((RECORDED / "aws" / "spot-advisor-data.json").read_text())
    assert aws_spot(advisor, "ap-northeast-1", {"p4d.24xlarge"}) == {"p4d.24xlarge": (0.54, "<5%")}
    body = json.loads((RECORDED / "alicloud" / "cn-hangzhou" / "ecs.gn7i-c8g1.2xlarge.json").read_text())
    assert alicloud_price(body) == (11.5, "CNY")  # the instance's line, not the total with its system disk
    body["PriceInfo"]["Price"]["DetailInfos"] = {"ResourcePriceModel": body["PriceInfo"]["Price"]["DetailInfos"]["DetailInfo"]}
    assert alicloud_price(body) == (11.5, "CNY")  # older SDKs' name for the list
    history = json.loads((RECORDED / "alicloud" / "cn-hangzhou" / "ecs.gn7i-c8g1.2xlarge.spot.json").read_text())
    assert alicloud_spot(history, "ecs.gn7i-c8g1.2xlarge") == 0.70  # 1 - mean(SpotPrice / OriginPrice)
    with pytest.raises(PriceSourceError, match="no spot price"):
        alicloud_spot(history, "ecs.gn6i-c4g1.xlarge")
    tencent = json.loads((RECORDED / "tencentcloud" / "ap-guangzhou" / "GN7.2XLARGE32.json").read_text())
    assert tencentcloud_price(tencent) == 8.68
    with pytest.raises(PriceSourceError, match="AuthFailure"):
        tencentcloud_price({"Response": {"Error": {"Code": "AuthFailure", "Message": "no"}, "RequestId": "x"}})


# ---------------------------------------------------------------------- make prices

def test_make_prices_on_the_recorded_responses_reproduces_the_shipped_rows(tmp_path: Path) -> None:
    path = prices_copy(tmp_path)
    result = run("--recorded", str(RECORDED), "--file", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no price changed" in result.stdout and "wrote" in result.stdout
    assert figures(path) == figures(cat.DATA_DIR / "prices.csv")
    _, rows = refresh.read(path)
    ali = next(p for p in rows if p.instance_type == "ecs.gn7i-c8g1.2xlarge")
    assert not ali.estimate and ali.source.startswith("Alibaba Cloud ECS DescribePrice")  # now read from the API
    assert ali.spot_source.startswith("Alibaba Cloud ECS DescribeSpotPriceHistory")  # its spot discount too
    assert "skipped" in result.stdout and "p3.8xlarge us-east-1: not in the offer file" in result.stdout


def _moved_prices(tmp: Path, factor: float) -> Path:
    """A recorded folder whose us-east-1 p4d price moved by `factor`."""
    folder = tmp / "recorded"
    shutil.copytree(RECORDED, folder)
    offer = folder / "aws" / "offer-us-east-1.csv"
    offer.write_text(offer.read_text().replace('"21.9576420000"', f'"{21.957642 * factor:.10f}"'))
    return folder


def test_a_large_change_is_refused_without_accept(tmp_path: Path) -> None:
    path = prices_copy(tmp_path)
    before = path.read_text()
    folder = _moved_prices(tmp_path, 1.4)
    result = run("--recorded", str(folder), "--file", str(path), "--cloud", "aws")
    assert result.returncode == 1 and "refused" in result.stderr and "refused" not in result.stdout
    assert "p4d.24xlarge" in result.stdout and "+40.0" in result.stdout
    assert path.read_text() == before
    accepted = run("--recorded", str(folder), "--file", str(path), "--cloud", "aws", "--accept")
    assert accepted.returncode == 0
    assert figures(path)[("aws", "p4d.24xlarge", "us-east-1")][0] == pytest.approx(21.957642 * 1.4)
    small = run("--recorded", str(_moved_prices(tmp_path / "b", 1.05)), "--file", str(prices_copy(tmp_path / "b")),
                "--cloud", "aws")
    assert small.returncode == 0 and "+5.0" in small.stdout  # under the threshold: written


def test_a_new_region_is_priced_from_its_offer_file(tmp_path: Path) -> None:
    path = prices_copy(tmp_path)
    path.write_text("\n".join(line for line in path.read_text().splitlines() if ",us-west-2," not in line) + "\n")
    result = run("--recorded", str(RECORDED), "--file", str(path), "--cloud", "aws", "--region", "us-west-2")
    assert result.returncode == 0, result.stdout
    got = figures(path)
    assert got[("aws", "p4d.24xlarge", "us-west-2")][0] == 21.95764 and got[("aws", "g6.xlarge", "us-west-2")][0] == 0.8048
    assert got[("aws", "p5.48xlarge", "us-west-2")][2:4] == (0.46, "5-10%")  # the Advisor's figures for us-west-2
    assert ("aws", "p3.2xlarge", "us-west-2") not in got  # not in that offer file: no row, said so
    bad = run("--recorded", str(RECORDED), "--file", str(path), "--region", "us-west-2")
    assert bad.returncode == 2 and "needs one CLOUD" in bad.stderr and bad.stdout == ""


# -------------------------------------------------------------- every figure, its region

def _moved_dev(tmp: Path, region: str) -> Path:
    config = stack_values("dev")
    config["gpu-training-stack:clouds"]["aws"]["region"] = region
    net = next(n for n in config["gpu-training-stack:networks"] if n["cloud"] == "aws")
    net["subnets"] = [{"zone": f"{region}a", "cidr": "10.10.0.0/20"}]
    proj = project_copy(tmp)
    write_stack(proj, "dev", config)
    return proj


def _plan(proj: Path, stack: str = "dev") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.plan", "--stack", stack, "--format", "json"], cwd=proj,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})


def test_dev_moved_to_another_region_is_priced_at_that_regions_price(tmp_path: Path) -> None:
    result = _plan(_moved_dev(tmp_path, "eu-west-1"))
    assert result.returncode in (0, 1), result.stderr
    plan = json.loads(result.stdout)
    aws = next(g for g in plan["cost"]["node_groups"] if g["cloud"] == "aws")
    home = next(g for g in json.loads(_plan(ROOT).stdout)["cost"]["node_groups"] if g["cloud"] == "aws")
    item = cat.load_catalog().priced("aws", aws["instance_type"], "eu-west-1")
    assert item is not None and aws["region"] == "eu-west-1" and home["region"] == "us-east-1"
    assert aws["node_hourly_usd"] == pytest.approx(item.price_ondemand) and aws["price_estimate"] == item.price_estimate
    assert aws["node_hourly_usd"] > home["node_hourly_usd"] * 1.1  # Ireland lists 11-12 % over Virginia
    assert any(p["region"] == "eu-west-1" for p in plan["cost"]["prices"]["used"])


def test_the_node_env_and_the_policy_pack_use_the_groups_region(tmp_path: Path) -> None:
    spec = load_stack_spec("dev", _moved_dev(tmp_path, "eu-west-1"))
    stack = resolve(spec)
    aws = stack.group("aws-train")
    assert float(aws.trainer["NODE_HOURLY_USD"]) == pytest.approx(aws.node_hourly_usd)
    assert aws.prices.on_demand == pytest.approx(cat.load_catalog().priced("aws", aws.types[0], "eu-west-1").price_ondemand)  # type: ignore[union-attr]
    config = policy_config.for_stack("dev", stack)
    assert config["node-group-cost-cap"]["groupPrices"]["aws-train"][aws.types[0]] == pytest.approx(aws.prices.on_demand)
    # The pack prices a p4d group at the price the stack gives for its region: over a cap us-east-1 would meet.
    asg = Res("aws:autoscaling/group:Group", "g-asg", {"maxSize": 1, "mixedInstancesPolicy": {"launchTemplate": {
        "overrides": [{"instanceType": "p4d.24xlarge"}]}}, "tags": [
        {"key": "gpu-training-stack:node-group", "value": "g", "propagateAtLaunch": True}]})
    cap = {"maxHourlyUsdPerGroup": 23.0, "cnyPerUsd": 7.2}
    catalog = cat.load_catalog()
    east, europe = (catalog.priced("aws", "p4d.24xlarge", r) for r in ("us-east-1", "eu-west-1"))
    assert east and europe
    assert group_cost_cap([asg], {**cap, "groupPrices": {"g": {"p4d.24xlarge": east.price_ondemand}}}) == []
    assert group_cost_cap([asg], {**cap, "groupPrices": {"g": {"p4d.24xlarge": europe.price_ondemand}}})
    # a pool named <group>-od is its group's; the longest group name that fits wins
    pool = Res("aws:autoscaling/group:Group", "g-big-od", {**asg.props, "tags": [
        {"key": "gpu-training-stack:node-group", "value": "g-big-od", "propagateAtLaunch": True}]})
    prices = {"g": {"p4d.24xlarge": 30.0}, "g-big": {"p4d.24xlarge": 1.0}}
    assert group_cost_cap([pool], {**cap, "groupPrices": prices}) == []


def test_a_type_without_a_price_in_the_region_names_group_region_and_type(tmp_path: Path) -> None:
    result = _plan(_moved_dev(tmp_path, "ap-southeast-1"))
    assert result.returncode == 2
    assert "nodeGroups[0].gpu" in result.stderr and "node group aws-train" in result.stderr
    assert "ap-southeast-1" in result.stderr and "make prices CLOUD=aws REGION=ap-southeast-1" in result.stderr
    # a price given for that region makes it plannable, and it is the one used
    (tmp_path / "b").mkdir()
    proj = _moved_dev(tmp_path / "b", "ap-southeast-1")
    config = yaml.safe_load((proj / "Pulumi.dev.yaml").read_text())["config"]
    config["gpu-training-stack:pricing"] = {"overrides": [
        {"cloud": "aws", "instanceType": "g4dn.2xlarge", "region": "ap-southeast-1", "onDemandHourly": 1.0}]}
    write_stack(proj, "dev", config)
    plan = _plan(proj)
    assert plan.returncode in (0, 1), plan.stderr
    aws = next(g for g in json.loads(plan.stdout)["cost"]["node_groups"] if g["cloud"] == "aws")
    assert (aws["instance_type"], aws["node_hourly_usd"], aws["region"]) == ("g4dn.2xlarge", 1.0, "ap-southeast-1")


def test_the_prices_age_is_a_policy_verdict_never_an_error() -> None:
    """Old prices are the pack's prices-fresh verdict (advisory by default, its level the pack
    config's) with the age and `make prices`; the calendar never makes the spec invalid."""
    from infra.stack import policy_config
    from policies.gts_policy.rules import evaluate

    spec = load_stack_spec("dev")
    stack = resolve(spec)
    oldest = age.summary(stack)["oldest"]
    when = age.parse(oldest["date"])

    def verdicts(days: int, level: str | None = None) -> list[dict[str, str]]:
        config = policy_config.for_stack("dev", stack)
        config["prices-fresh"] = {**config["prices-fresh"], **age.verdict_config(stack, when + datetime.timedelta(days=days)),
                                  **({"enforcementLevel": level} if level else {})}
        return [v for v in evaluate([], config) if v["policy"] == "prices-fresh"]

    assert verdicts(30) == []
    [note] = verdicts(120)
    assert note["enforcement"] == "advisory" and "120 days old" in note["message"] and "make prices" in note["message"]
    [late] = verdicts(4000)  # ten years on: still a verdict, not an error
    assert late["enforcement"] == "advisory" and "4000 days old" in late["message"]
    [strict] = verdicts(4000, "mandatory")  # the organisation's pack config sets the level
    assert strict["enforcement"] == "mandatory"
    allowed = spec.model_copy(update={"pricing": spec.pricing.model_copy(update={"allow_stale_prices": True})})
    assert age.verdict_config(resolve(allowed), when + datetime.timedelta(days=4000)) == {}


def test_bad_answers_write_nothing_and_exit_2(tmp_path: Path) -> None:
    path = prices_copy(tmp_path)
    before = path.read_text()
    folder = tmp_path / "recorded"
    shutil.copytree(RECORDED, folder)
    offer = folder / "aws" / "offer-us-east-1.csv"
    offer.write_text(offer.read_text().replace('"Publication Date","2026-09-10T19:55:14Z"', '"Publication Date","Sept 10"'))
    dated = run("--recorded", str(folder), "--file", str(path), "--cloud", "aws")
    assert dated.returncode == 2 and "is not a date" in dated.stderr and "Traceback" not in dated.stderr
    offer.write_text((RECORDED / "aws" / "offer-us-east-1.csv").read_text().replace('"0.5260000000"', '"n/a"'))
    garbled = run("--recorded", str(folder), "--file", str(path), "--cloud", "aws")
    assert garbled.returncode == 2 and "is not a number" in garbled.stderr
    (folder / "alicloud" / "cn-hangzhou" / "ecs.gn7i-c8g1.2xlarge.json").write_text("{not json")
    broken = run("--recorded", str(folder), "--file", str(path), "--cloud", "alicloud")
    assert broken.returncode == 2 and "not a JSON object" in broken.stderr
    assert path.read_text() == before


def test_tencent_skips_what_is_not_sold_and_what_another_site_bills(tmp_path: Path) -> None:
    path = prices_copy(tmp_path)
    folder = tmp_path / "recorded"
    shutil.copytree(RECORDED, folder)
    (folder / "tencentcloud" / "ap-guangzhou" / "GN10X.2XLARGE40.json").write_text(json.dumps(
        {"Response": {"Error": {"Code": "InvalidInstanceType.NotSupported", "Message": "not sold"}, "RequestId": "r"}}))
    result = run("--recorded", str(folder), "--file", str(path), "--cloud", "tencentcloud")
    assert result.returncode == 0, result.stdout
    assert "GN10X.2XLARGE40 ap-guangzhou: InquiryPriceRunInstances: InvalidInstanceType.NotSupported" in result.stdout
    other_site = run("--recorded", str(folder), "--file", str(path), "--cloud", "tencentcloud", "--site", "international")
    assert other_site.returncode == 0 and "this account's site bills USD; not changed" in other_site.stdout


def test_new_regions_start_without_another_regions_band_and_face_the_threshold(tmp_path: Path) -> None:
    _, rows = refresh.read(cat.DATA_DIR / "prices.csv")
    [new] = [p for p in refresh.targets(rows, ["aws"], ["eu-central-1"])
             if p.instance_type == "p5.48xlarge" and p.region == "eu-central-1"]
    assert new.spot_band == "" and new.spot_source == "catalog estimate (as in us-east-1)" and new.estimate
    fresh = [dataclasses.replace(new, on_demand=new.on_demand * 1.5)]
    _, changes = refresh.merge(rows, fresh)
    assert changes[0].old is None and changes[0].pct == pytest.approx(50.0)  # against the reference region
