"""Issue 30 item 3: the flights demo is a dataset preset (pipelines.presets). Nothing outside pipelines/flights
names it (but the CLI's help texts that name the demo), and a user's preset registered the same way is what
``--enrichment auto``, the stream's topic defaults and ``flowtrain batch`` without ``--input`` use."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from connectors.dataset import FORMAT, MANIFEST
from connectors.dataset_spec import FeatureSpec
from flowtrain.commands.batch.job import BatchJob, run_batch
from flowtrain.commands.stream.inputs import enrichment
from flowtrain.commands.stream.options import StreamPipelineJob, StreamScoreJob, dataset_name, with_dataset_topics
from flowtrain.errors import FlowtrainError
from pipelines.presets import DatasetPreset, default_preset, get_preset, preset_for, register_preset, unregister_preset

ROOT = Path(__file__).resolve().parents[2]
SENSORS_SPEC = FeatureSpec(label="failed", task="classification", numeric=["temp"], categorical=["site"])


def _flights_tokens(path: Path) -> list[tuple[int, int, str]]:
    """(line, token type, text) of every token of ``path`` that says "flights" (comments included)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.type, t.string) for t in tokens if "flights" in t.string.lower()]


def test_flights_named_only_under_pipelines_flights_and_in_cli_help_texts():
    """grep -rn flights flowtrain connectors pipelines --include=*.py | grep -v pipelines/flights/: only help texts
    (string literals) in flowtrain/cli; no code, comment or docstring elsewhere."""
    found = []
    for top in ("flowtrain", "connectors", "pipelines"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("pipelines/flights/"):
                continue
            for line, kind, text in _flights_tokens(path):
                if rel.startswith("flowtrain/cli/") and kind == tokenize.STRING and "import" not in text:
                    continue  # a help text that names the demo
                found.append(f"{rel}:{line}: {text.strip()[:80]}")
    assert not found, "the flights demo is named outside pipelines/flights (ask pipelines.presets):\n" + "\n".join(found)


def test_flights_demo_is_the_default_preset_registered_like_any_other():
    demo = default_preset()
    assert demo is get_preset(demo.name) and demo.name == "flights"  # its topics: flights-raw, ... as before
    assert demo.build is not None and demo.enrichment is not None and demo.replay is not None
    manifest = {"spec": demo.spec.to_dict(), "inputs": {"flights": "f", "weather": "w", "planes": "p"}}
    assert preset_for(manifest) is demo  # a dataset the demo's ETL wrote
    assert preset_for({"spec": SENSORS_SPEC.to_dict(), "inputs": ["a.csv"]}) is None  # your own files: no preset


class SensorSites:
    """The test preset's enrichment factory (picklable, as the stream needs)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self):
        return None


def _sensor_inputs(directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sites.csv").write_text("site,lat\na,1\n")
    return {"sites": str(directory / "sites.csv")}


class BuiltByPreset(RuntimeError):
    pass


def _build(inputs, *, dataset_path, dead_letters_path, options, spec):
    raise BuiltByPreset(f"sensors ETL on {sorted(inputs)} into {dataset_path} with label {spec.label}")


@pytest.fixture
def sensors(monkeypatch, tmp_path):
    """A user's preset, registered as the default for the test (the demo's registration restored after)."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))
    demo = default_preset()
    preset = register_preset(DatasetPreset(
        name="sensors", spec=SENSORS_SPEC, title="sensor failures", describe="sensor readings + sites",
        inputs=_sensor_inputs, build=_build, enrichment=lambda inputs: SensorSites(inputs["sites"]),
        matches=lambda manifest: (manifest.get("spec") or {}).get("label") == "failed"), default=True)
    yield preset
    unregister_preset("sensors")
    register_preset(demo, default=True)


def _dataset(directory: Path, spec: FeatureSpec, **extra) -> str:
    directory.mkdir(parents=True)
    manifest = {"format": FORMAT, "spec": spec.to_dict(), "stats": {}, "splits": {}, **extra}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return str(directory)


def test_user_preset_gives_enrichment_auto_and_topic_defaults(sensors, tmp_path):
    dataset = _dataset(tmp_path / "plant-7" / "dataset", SENSORS_SPEC)
    manifest = json.loads((Path(dataset) / MANIFEST).read_text())
    assert preset_for(manifest) is sensors
    # topics: the preset's name, not the directory's (plant-7)
    assert dataset_name(dataset) == "sensors"
    job = with_dataset_topics(StreamPipelineJob(dataset=dataset))
    assert (job.raw_topic, job.features_topic, job.dead_letter_topic) == (
        "sensors-raw", "sensors-features", "sensors-dead-letters")
    score = with_dataset_topics(StreamScoreJob(dataset=dataset))
    assert (score.predictions_topic, score.score_dead_letter_topic) == ("sensors-predictions",
                                                                       "sensors-scoring-dead-letters")
    # --enrichment auto: the preset's, built from its inputs (written under the cache once)
    factory = enrichment(StreamPipelineJob(dataset=dataset, enrichment="auto"), manifest)
    assert isinstance(factory, SensorSites)
    assert Path(factory.path) == tmp_path / "cache" / "sensors" / "sites.csv" and Path(factory.path).exists()
    assert isinstance(enrichment(StreamPipelineJob(dataset=dataset, enrichment="sensors"), manifest), SensorSites)
    assert enrichment(StreamPipelineJob(dataset=dataset, enrichment="none"), manifest) is None


def test_a_dataset_of_your_own_files_has_no_enrichment_and_topics_from_its_name(sensors, tmp_path):
    own = FeatureSpec(label="price", task="regression", numeric=["rooms"])
    dataset = _dataset(tmp_path / "houses" / "dataset", own)
    manifest = json.loads((Path(dataset) / MANIFEST).read_text())
    assert preset_for(manifest) is None
    assert dataset_name(dataset) == "houses"
    assert enrichment(StreamPipelineJob(dataset=dataset, enrichment="auto"), manifest) is None
    # a manifest that names its preset is that preset's, whatever its spec
    named = _dataset(tmp_path / "named" / "dataset", own, preset="sensors")
    assert dataset_name(named) == "sensors"


def test_enrichment_of_an_unknown_preset_is_one_line_naming_the_registered_ones(sensors, tmp_path):
    dataset = _dataset(tmp_path / "d" / "dataset", SENSORS_SPEC)
    with pytest.raises(SystemExit) as err:
        enrichment(StreamPipelineJob(dataset=dataset, enrichment="weather"), {})
    text = str(err.value)
    assert "--enrichment weather" in text and "sensors" in text and "\n" not in text


def test_batch_without_input_builds_the_default_preset(sensors, tmp_path):
    """``flowtrain batch`` without --input runs the default preset's ETL on its demo inputs."""
    with pytest.raises((BuiltByPreset, FlowtrainError), match=r"sensors ETL on \['sites'\] .* with label failed"):
        run_batch(BatchJob(out=str(tmp_path / "run"), runner="FnApiRunner"))


#: A preset that is not registered until ``--preset tests.unit.test_presets:GAUGES`` loads it.
GAUGES = DatasetPreset(name="gauges", spec=SENSORS_SPEC, inputs=_sensor_inputs, build=_build)


def test_batch_preset_option_builds_the_named_or_loaded_preset(sensors, tmp_path):
    """--preset NAME (registered) or MODULE:NAME (loaded and registered); unknown: one line naming it."""
    try:
        # (RuntimeError: the module loaded by name may be a second copy of this one, with its own BuiltByPreset)
        with pytest.raises((RuntimeError, FlowtrainError), match=r"sensors ETL on \['sites'\] .*a/dataset"):
            run_batch(BatchJob(out=str(tmp_path / "a"), preset="tests.unit.test_presets:GAUGES"))
        assert get_preset("gauges").name == "gauges"
        with pytest.raises(FlowtrainError, match=r"--preset\): no dataset preset named 'nosuch' .*gauges"):
            run_batch(BatchJob(out=str(tmp_path / "b"), preset="nosuch"))
        with pytest.raises(FlowtrainError, match="leave out --input"):
            run_batch(BatchJob(out=str(tmp_path / "c"), preset="gauges", input=("x.csv",), label="y"))
    finally:
        unregister_preset("gauges")


def test_presets_from_the_environment_and_a_broken_source_is_one_line(tmp_path):
    """$FLOWTRAIN_PRESETS MODULE:NAME registers a preset in a fresh process; a module that cannot be imported
    stops a command with one line naming the variable (not a traceback)."""
    env = {**os.environ, "FLOWTRAIN_PRESETS": "tests.unit.test_presets:GAUGES"}
    found = subprocess.run([sys.executable, "-c", "from pipelines.presets import get_preset; "
                            "print(get_preset('gauges').name)"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == "gauges", found.stderr
    env["FLOWTRAIN_PRESETS"] = "no_such_preset_module"
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "replay", "--bootstrap", "127.0.0.1:9", "--limit",
                           "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1:] == [
        "flowtrain replay: $FLOWTRAIN_PRESETS: cannot load dataset preset 'no_such_preset_module' (ModuleNotFoundError: "
        "No module named 'no_such_preset_module'); give MODULE or MODULE:NAME of an importable module"]


def test_preset_names_are_topic_safe_and_specs_typed():
    with pytest.raises(ValueError, match="topic"):
        DatasetPreset(name="my sensors", spec=SENSORS_SPEC)
    with pytest.raises(ValueError, match="FeatureSpec"):
        DatasetPreset(name="sensors", spec={"label": "failed"})
