"""--aggregate and --join: the declarations, their feature names, and one-line errors naming the bad part."""
from __future__ import annotations

import pytest

from connectors.fields import OptionError, build
from flowtrain.commands.features.job import FeaturesJob
from pipelines.features.declare import DeclarationError, declare, parse_aggregate, parse_join
from pipelines.features.options import FeatureOptions


def test_the_issues_examples_and_their_feature_names():
    d = declare(["card:amount:count,sum,mean,max,std:10m,1h,1d,30d", "card:*:count:10m,1h",
                 "card:merchant:distinct:1d", "card:category:last3:30d", "card+merchant:amount:sum:life"],
                ["merchants.parquet:merchant:valid_from", "gs://bucket/t.parquet:card"])
    names = d.aggregate_names()
    assert names[:3] == ["card_seen", "card_amount_count_10m", "card_amount_sum_10m"]
    assert "card_amount_std_30d" in names and "card_count_1h" in names
    assert "card_merchant_distinct_1d" in names
    assert [n for n in names if "last3" in n] == ["card_category_last3_30d_1", "card_category_last3_30d_2",
                                                  "card_category_last3_30d_3"]
    assert "card_merchant_seen" in names and "card_merchant_amount_sum_life" in names
    assert d.aggregations[0].windows[3].seconds == 30 * 86400 and d.aggregations[4].windows[0].seconds is None
    merchants, static = d.joins
    assert (merchants.table, merchants.key, merchants.valid_from) == ("merchants.parquet", ("merchant",), "valid_from")
    assert merchants.column_name("risk_tier") == "merchant_risk_tier"
    assert (static.table, static.key, static.valid_from) == ("gs://bucket/t.parquet", ("card",), None)


def test_yaml_mappings_are_the_same_declarations():
    text = parse_aggregate("card:amount:sum,max:1h,1d")
    mapping = parse_aggregate({"key": "card", "column": "amount", "aggs": ["sum", "max"], "windows": ["1h", "1d"]})
    assert text == mapping
    assert parse_join({"table": "m.csv", "key": "merchant", "valid_from": "vf"}) == parse_join("m.csv:merchant:vf")


@pytest.mark.parametrize("text, message", [
    ("card:amount:sum", "expected KEY:COLUMN:AGGS:WINDOWS with 4 parts"),
    ("card:amount:median:1h", "aggregation 'median': expected one of count, sum"),
    ("card:amount:sum:10x", "window '10x': expected Ns, Nm, Nh or Nd"),
    ("card:amount:sum:0m", "window '0m'"),
    ("card:amount:last0:1h", "aggregation 'last0'"),
    ("card:*:sum:1h", "sum of * (the key's events): * takes count only"),
    ("card:amount:sum:60m,1h", "windows 60m and 1h are the same length"),
    ("card:amount:sum,sum:1h", "aggregation sum is given twice"),
    ("card+:amount:sum:1h", "key 'card+'"),
    ("card:card:sum:1h", "column 'card' is the key itself"),
    ("card:amount::1h", "no aggregation"),
])
def test_a_bad_aggregate_is_one_line_naming_the_bad_part(text, message):
    with pytest.raises(DeclarationError) as err:
        declare([text])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"--aggregate {text}: ")


def test_a_feature_declared_twice_is_refused():
    with pytest.raises(DeclarationError, match="feature card_amount_sum_1h is also made by --aggregate card:amount"):
        declare(["card:amount:sum:1h", "card:amount:max,sum:1h"])


@pytest.mark.parametrize("text, message", [
    ("merchants.parquet", "expected TABLE:KEY or TABLE:KEY:VALID_FROM"),
    ("m.csv:merchant:vf:x", "expected TABLE:KEY or TABLE:KEY:VALID_FROM"),
    (":merchant", "no TABLE"),
    ("m.csv:merchant:merchant", "VALID_FROM 'merchant'"),
])
def test_a_bad_join_is_one_line_naming_the_bad_part(text, message):
    with pytest.raises(DeclarationError, match=message):
        declare(joins=[text])


def test_the_options_check_each_declaration_as_they_are_parsed():
    ok = build(FeatureOptions, aggregations=["card:amount:sum:1h"], joins=[{"table": "m.csv", "key": "merchant"}])
    assert ok.declaration().aggregate_names() == ["card_seen", "card_amount_sum_1h"]
    with pytest.raises(OptionError, match=r"^aggregations \(--aggregate\): card:amount:sum:1x: window '1x'"):
        build(FeatureOptions, aggregations=["card:amount:sum:1x"])


def test_flowtrain_features_takes_repeated_flags_and_yaml_lists(tmp_path):
    from flowtrain.cli.main import parse

    (tmp_path / "c.yaml").write_text(
        "aggregations:\n  - card:amount:sum,mean:1h,1d\n  - card:*:count:10m\n"
        "joins: ['m.csv:merchant:valid_from']\ntime_column: t\n")
    args, _ = parse(["features", "--config", str(tmp_path / "c.yaml"), "--input", "x.csv", "--out", "o.parquet"])
    job = build(FeaturesJob, args.options)
    assert job.declaration().aggregate_names() == [
        "card_seen", "card_amount_sum_1h", "card_amount_mean_1h", "card_amount_sum_1d", "card_amount_mean_1d",
        "card_count_10m"]
    args, _ = parse(["features", "--input", "x.csv", "--out", "o.parquet", "--time-column", "t",
                     "--aggregate", "card:amount:count,sum:10m,1h", "--aggregate", "card:*:count:1h",
                     "--join", "m.csv:merchant"])
    job = build(FeaturesJob, args.options)
    assert job.aggregations == ("card:amount:count,sum:10m,1h", "card:*:count:1h") and job.joins == ("m.csv:merchant",)
