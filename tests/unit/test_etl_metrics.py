"""The tabular ETL counts with Beam's Metrics: ``PipelineResult.metrics()`` of a FnApiRunner run equals
the manifest's rows in, rows out per split and dead letters by reason (on Prism:
tests/integration/test_etl_metrics_prism.py)."""
from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter

from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from connectors.files import ReadFromFiles
from pipelines.tabular.pipeline import METRICS_NAMESPACE, build_etl
from pipelines.tabular.preflight import preflight
from pipelines.tabular.schema import read_types


def test_beam_metrics_of_a_fnapirunner_run_equal_the_runs_rows_and_dead_letters(tmp_path):
    check_etl_metrics(tmp_path, beam.Pipeline(runner="FnApiRunner"))


def check_etl_metrics(tmp_path, p: beam.Pipeline) -> None:
    """The ETL on 400 rows (some unreadable, some missing a value) in pipeline ``p``; its metrics
    equal the manifest's counts and the dead letters written."""
    lines = ["x,c,y"]
    for i in range(400):
        x = "" if i % 37 == 5 else ("abc" if i % 53 == 7 else f"{i / 100:.2f}")  # missing: dead; text: unreadable
        lines.append(f"{x},{'ab'[i % 2]},{(i * 7) % 11 / 3:.3f}")
    csv = tmp_path / "data.csv"
    csv.write_text("\n".join(lines) + "\n")
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"])
    preflight([str(csv)], spec)
    dataset, dead_path = tmp_path / "ds", tmp_path / "dead.jsonl"
    raw, read_errs = p | "ReadFiles" >> ReadFromFiles([str(csv)], with_source=True, columns=[*spec.input_columns],
                                                      column_types=read_types(spec), with_errors=True)
    build_etl(raw, spec, dataset_path=str(dataset), dead_letters_path=str(dead_path), read_errs=read_errs)
    result = p.run()
    result.wait_until_finish()
    counts = read_manifest(str(dataset))["counts"]
    assert counts["in"] == 400 and counts["dead_letters"] > 0 and len(counts["dead_letters_by_reason"]) >= 2

    found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    counters = {}
    for c in found["counters"]:
        counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + (c.committed or c.attempted)
    assert counters["rows_in"] == counts["in"]
    assert counters["rows_out"] == counts["out"]
    assert {k[len("rows_out: "):]: v for k, v in counters.items() if k.startswith("rows_out: ")} \
        == counts["out_by_split"]
    assert counters["dead_letters"] == counts["dead_letters"]
    assert {k[len("dead_letters: "):]: v for k, v in counters.items() if k.startswith("dead_letters: ")} \
        == counts["dead_letters_by_reason"]
    written = [json.loads(line) for line in dead_path.read_text().splitlines()]
    assert len(written) == counters["dead_letters"]
    assert counters["bytes_read"] > 0
    dists = {d.key.metric.name: (d.committed or d.attempted) for d in found["distributions"]}
    assert dists["validate_ms"].count >= 1 and dists["featurize_ms"].count >= 1
