"""The GPU catalog and its prices per region: loaders, the selector, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.core import catalog as cat
from infra.core.errors import CatalogError


def test_catalog_loads_all_required_families() -> None:
    c = cat.load_catalog()
    families = {(t.cloud, t.family) for t in c.types.values()}
    for fam in ("p3", "p3dn", "p4d", "p4de", "p5", "g4dn", "g5", "g6", "g6e"):
        assert ("aws", fam) in families, fam
    for fam in ("gn6v", "gn6i", "gn7", "gn7e", "gn7i", "gn8is"):
        assert ("alicloud", fam) in families, fam
    for fam in ("GN10Xp", "GN10X", "GT4", "PNV4", "GN7"):
        assert ("tencentcloud", fam) in families, fam


def test_verified_specs_from_cloud_facts() -> None:
    c = cat.load_catalog()
    p4d = c.get("aws", "p4d.24xlarge")
    assert p4d and (p4d.gpu_count, p4d.gpu_vram_gb, p4d.ram_gib, p4d.nvme_gb) == (8, 40, 1152, 8000)
    assert (p4d.price_ondemand, p4d.price_region, p4d.price_date) == (21.957642, "us-east-1", "2026-09-10")
    gn = c.get("tencentcloud", "GN10Xp.5XLARGE80")
    assert gn and (gn.gpu_count, gn.gpu_vram_gb) == (2, 32)  # 32 GB V100s, not 16
    assert c.get("alicloud", "p4v.2xlarge") is None  # the guide's made-up type
    # Every non-USD price is flagged as an estimate: nobody could verify them.
    assert all(t.price_estimate for t in c.types.values() if t.currency == "CNY")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cat.csv"
    path.write_text(text)
    return path


def test_loader_rejects_wrong_schema_and_columns(tmp_path: Path) -> None:
    good = cat.CATALOG_PATH.read_text()
    prices = cat.CATALOG_PATH.with_name("prices.csv")

    def load(text: str, price_text: str | None = None) -> None:
        path = _write(tmp_path, text)
        (tmp_path / "prices.csv").write_text(price_text if price_text is not None else prices.read_text())
        cat.load_catalog_file(path)

    with pytest.raises(CatalogError, match="schema_version"):
        load(good.replace("schema_version=2", "schema_version=9"))
    with pytest.raises(CatalogError, match="columns"):
        load(good.replace("gpu_vram_gb", "vram"))
    with pytest.raises(CatalogError, match="duplicate"):
        row = next(line for line in good.splitlines() if line.startswith("aws,p3.2xlarge"))
        load(good + row + "\n")
    with pytest.raises(CatalogError, match="prices.csv:"):
        load(good, prices.read_text().replace(",3.06,USD", ",cheap,USD"))
    with pytest.raises(CatalogError, match="duplicate price"):
        row = next(line for line in prices.read_text().splitlines() if line.startswith("aws,p3.2xlarge"))
        load(good, prices.read_text() + row + "\n")
    with pytest.raises(CatalogError, match="no price for aws p3.2xlarge"):
        load(good, "\n".join(line for line in prices.read_text().splitlines() if not line.startswith("aws,p3.2xlarge,")))
    with pytest.raises(CatalogError, match="date must be"):
        load(good, prices.read_text().replace(",2026-09-10,", ",last week,", 1))


def test_prices_are_per_region_with_source_and_date() -> None:
    c = cat.load_catalog()
    east, west, tokyo = (c.priced("aws", "p4d.24xlarge", r) for r in ("us-east-1", "eu-west-1", "ap-northeast-1"))
    assert east and west and tokyo
    assert (east.price_ondemand, west.price_ondemand, tokyo.price_ondemand) == (21.957642, 23.71569, 30.10)
    assert west.price_source.startswith("AWS Price List bulk offer") and not west.price_estimate
    assert tokyo.price_estimate  # quoted, not read from the price list here
    assert c.priced("aws", "p4d.24xlarge", "af-south-1") is None
    assert (west.gpu_count, west.ram_gib) == (east.gpu_count, east.ram_gib)  # one set of specs
    assert east.spot_band == "10-15%" and east.spot_discount == 0.67  # the Spot Advisor, us-east-1
    sa = c.priced("aws", "g5.xlarge", "sa-east-1")
    assert sa and sa.price_ondemand == 1.71 and c.priced("aws", "g5.xlarge", "us-east-1").price_ondemand == 1.006  # type: ignore[union-attr]


def test_the_selector_ranks_and_filters_by_the_region() -> None:
    c = cat.load_catalog()
    req = cat.Requirement(gpu_count=1, gpu_model="T4")
    east = cat.select(c, ["aws"], req, 7.2, "us-east-1")
    europe = cat.select(c, ["aws"], req, 7.2, "eu-west-1")
    assert {p.type.instance_type for p in europe} <= {p.type.instance_type for p in east}
    assert all(p.type.price_region == "eu-west-1" for p in europe)
    assert cat.select(c, ["aws"], req, 7.2, "af-south-1") == []


def test_selector_cheapest_first_across_clouds() -> None:
    c = cat.load_catalog()
    req = cat.Requirement(gpu_count=8, gpu_model="A100")
    picks = cat.select(c, cat.CLOUDS, req, cny_per_usd=7.2)
    assert picks, "8 x A100 exists on every cloud"
    prices = [p.hourly_usd for p in picks]
    assert prices == sorted(prices)
    assert {p.type.cloud for p in picks} == {"aws", "alicloud", "tencentcloud"}
    # Tencent GT4.41XLARGE948 at 253.84 CNY / 7.2 = 35.26 USD; p4d at 21.96 USD is cheapest.
    assert picks[0].type.instance_type == "p4d.24xlarge"


def test_selector_applies_ram_and_scratch_rules() -> None:
    c = cat.load_catalog()
    # 1 x T4: g4dn.xlarge has 16 GiB for 16 GB of VRAM (< 24): excluded.
    picks = cat.select(c, ["aws"], cat.Requirement(gpu_model="T4"), 7.2)
    assert all(p.type.ram_ok for p in picks)
    assert "g4dn.xlarge" not in [p.type.instance_type for p in picks]
    # instance-store scratch needs local NVMe; p3.2xlarge has none.
    nvme = cat.select(c, ["aws"], cat.Requirement(gpu_model="V100", scratch_gb=100, scratch_source="instance-store"), 7.2)
    assert nvme == []
    disk = cat.select(c, ["aws"], cat.Requirement(gpu_model="V100", scratch_gb=1000), 7.2)
    assert disk[0].type.instance_type == "p3.2xlarge" and disk[0].data_disk_gb == 1000
    # The disk is priced in: 1000 GB of gp3 at 0.08 USD/GB-month over 730 h.
    assert disk[0].hourly_usd == pytest.approx(3.06 + 1000 * 0.08 / 730, rel=1e-6)
    # A type whose NVMe holds the scratch needs no disk.
    p4d = cat.select(c, ["aws"], cat.Requirement(gpu_count=8, gpu_model="A100", scratch_gb=1000), 7.2)
    assert p4d[0].type.instance_type == "p4d.24xlarge" and p4d[0].data_disk_gb == 0


def test_price_overrides_replace_catalog_prices() -> None:
    c = cat.load_catalog().with_prices({("aws", "p4d.24xlarge", None): 10.0})
    item = c.get("aws", "p4d.24xlarge")
    assert item and item.price_ondemand == 10.0 and item.price_source == "stack override"
    assert c.priced("aws", "p4d.24xlarge", "eu-west-1").price_ondemand == 10.0  # type: ignore[union-attr]
    assert cat.load_catalog().get("aws", "p4d.24xlarge").price_ondemand == 21.957642  # type: ignore[union-attr]
    one = cat.load_catalog().with_prices({("aws", "p4d.24xlarge", "af-south-1"): 31.0})
    assert one.priced("aws", "p4d.24xlarge", "af-south-1").price_ondemand == 31.0  # type: ignore[union-attr]
    assert one.priced("aws", "p4d.24xlarge", "us-east-1").price_ondemand == 21.957642  # type: ignore[union-attr]
