"""Dataset presets (h6 item 6): a preset's dataset manifest records the preset that built it
(``DatasetPreset.build_dataset``; ``flowtrain batch --preset`` builds through it)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

import flowtrain
from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from flowtrain.local.runners import pipeline_options
from pipelines.presets import DatasetPreset, preset_for, register_preset, unregister_preset

pytestmark = pytest.mark.timeout(300)

SPEC = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"])


def _inputs(directory):
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = 200
    x = rng.normal(size=n)
    pacsv.write_csv(pa.table({"x": x, "c": rng.choice(["a", "b"], n), "y": 2 * x}), directory / "t.csv")
    return {"table": str(directory / "t.csv")}


def _build(inputs, *, dataset_path, dead_letters_path, options, spec):
    from pipelines.tabular.pipeline import run_tabular_etl

    return run_tabular_etl([inputs["table"]], spec, dataset_path=dataset_path, dead_letters_path=dead_letters_path,
                           options=options)


@pytest.fixture
def gauges():
    preset = register_preset(DatasetPreset(name="gauges-h6", spec=SPEC, inputs=_inputs, build=_build))
    yield preset
    unregister_preset("gauges-h6")


def test_a_presets_dataset_manifest_records_the_preset(gauges, tmp_path):
    manifest = gauges.build_dataset(gauges.demo_inputs(tmp_path / "cache"), dataset_path=str(tmp_path / "ds"),
                                    dead_letters_path=str(tmp_path / "dead.jsonl"), options=pipeline_options("batch"))
    written = read_manifest(tmp_path / "ds")
    assert manifest["preset"] == written["preset"] == "gauges-h6"
    assert preset_for(written) is gauges  # found by name, with no matches() to guess from
    assert manifest["counts"] == written["counts"] and written["rows"]["train"] > 0


def test_batch_preset_records_it_in_the_runs_dataset(gauges, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))
    flowtrain.batch(preset="gauges-h6", out=str(tmp_path / "run"), hidden=[4], batch_size=32, steps=1, threads=1,
                    no_progress=True)
    assert read_manifest(tmp_path / "run" / "dataset")["preset"] == "gauges-h6"
