"""Issue 45 item 5: `flowtrain replay` of a file without the label (the dataset's label) replays every row as an
unlabelled event and counts it; rows whose label is missing count as unlabelled; without a known label column the
count says it is not counted (it said 0). The malformed kinds are the names of their dead letters' reasons."""
from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from connectors.dataset import FORMAT
from connectors.dataset_spec import FeatureSpec
from connectors.deadletter import reason_kind
from flowtrain.commands.stream.options import ReplayJob
from flowtrain.commands.stream.replay import _table_events
from pipelines.stream.events import ParseBounds, event_schema, parse_event
from pipelines.stream.replay import MALFORMED_KINDS, malform_event
from pipelines.tabular.stats import StatsAccumulator

SPEC = FeatureSpec(label="status", task="classification", numeric=["x"], categorical=["city"])


@pytest.fixture
def dataset(tmp_path):
    """A dataset's manifest (the spec and the training statistics; the replay reads no shard)."""
    train = pa.RecordBatch.from_pydict({"x": [1.0, 2.0, 3.0, 4.0], "city": ["a", "b", "a", "b"],
                                        "status": ["yes", "no", "yes", "no"]})
    stats = StatsAccumulator().add(train, SPEC).finalize(SPEC)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "_manifest.json").write_text(json.dumps({"format": FORMAT, "spec": SPEC.to_dict(),
                                                                "stats": stats}))
    return str(tmp_path / "ds")


def _kinds(job: ReplayJob) -> list:
    events, _, _, label = _table_events(job)
    return [kind for _, _, _, kind in events], label


def test_a_file_without_the_datasets_label_replays_as_unlabelled_events(tmp_path, dataset, capsys):
    pacsv.write_csv(pa.table({"x": [1.0, 2.0, 3.0], "city": ["a", "b", "a"]}), tmp_path / "new.csv")
    kinds, label = _kinds(ReplayJob(input=(str(tmp_path / "new.csv"),), dataset=dataset, topic="t"))
    assert kinds == ["unlabelled"] * 3 and label == "status"
    assert "has no column 'status' (the label of --dataset" in capsys.readouterr().out
    # a --label given explicitly that is no column is still the user's typo
    with pytest.raises(ValueError, match="--label 'state' is not a column"):
        _kinds(ReplayJob(input=(str(tmp_path / "new.csv"),), dataset=dataset, topic="t", label="state"))


def test_rows_with_a_missing_label_count_as_unlabelled_and_an_unknown_label_is_not_counted(tmp_path, dataset):
    pacsv.write_csv(pa.table({"x": [1.0, 2.0, 3.0], "city": ["a", "b", "a"], "status": ["yes", None, "no"]}),
                    tmp_path / "t.csv")
    kinds, _ = _kinds(ReplayJob(input=(str(tmp_path / "t.csv"),), dataset=dataset, topic="t"))
    assert kinds == [None, "unlabelled", None]
    kinds, label = _kinds(ReplayJob(input=(str(tmp_path / "t.csv"),), topic="t"))  # no --dataset, no --label
    assert label is None and kinds == [None, None, None]


def test_each_malformed_kind_is_the_kind_of_its_dead_letter():
    schema = event_schema(SPEC)
    rng = random.Random(0)
    bounds = ParseBounds(max_event_bytes=2_000)
    event = {"x": 1.5, "city": "a", "status": "yes"}
    for kind in MALFORMED_KINDS:
        letter = parse_event(malform_event(event, kind, rng, schema, bounds), "raw/0/1", schema, bounds)
        assert reason_kind(letter.reason).startswith(kind), (kind, letter.reason)
    assert "infinite" in MALFORMED_KINDS and "not UTF-8" in MALFORMED_KINDS


def test_item6_replay_over_the_dead_letter_fraction_exits_3_before_sending(tmp_path, dataset, capsys):
    from flowtrain.cli.main import main

    x = [1.0, float("nan"), float("inf"), 4.0]  # two of four rows: no finite number where the stream needs one
    pacsv.write_csv(pa.table({"x": x, "city": ["a"] * 4, "status": ["yes"] * 4}), tmp_path / "t.csv")
    argv = ["replay", "--input", str(tmp_path / "t.csv"), "--dataset", dataset, "--topic", "t",
            "--bootstrap", "127.0.0.1:1", "--connect-timeout", "1"]  # no broker: the check comes first
    assert main([*argv, "--max-dead-letter-fraction", "0.25"]) == 3
    err = capsys.readouterr().err
    assert ("flowtrain replay: 2 of 4 rows of " in err and "(50.0%) are dead letters, more than "
            "--max-dead-letter-fraction 0.25 (numeric feature 'x' is missing or not a finite number (2)); see nothing was "
            "sent to t" in err), err
    with pytest.raises(SystemExit, match="no Kafka broker answered at 127.0.0.1:1"):  # under the bound: on to Kafka
        main([*argv, "--max-dead-letter-fraction", "0.5"])
