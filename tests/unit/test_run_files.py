"""Issue 48 item 4: a run directory is one concept. Its files are one table (flowtrain/train/rundir/files.py) from
which what a replacing run deletes follows, and the ``RunDir`` a run was prepared with ends it."""
from __future__ import annotations

import pytest

from flowtrain.train.rundir.files import RUN_DIRS, RUN_FILES, TABLE, RunFiles, file_name
from flowtrain.train.rundir.marker import RUN_MARKER, read_marker
from flowtrain.train.rundir.rules import prepare_run_dir


def test_each_file_has_one_name_and_one_path(tmp_path):
    assert len({f.name for f in TABLE}) == len(TABLE) and len({f.path for f in TABLE}) == len(TABLE)
    files = RunFiles(tmp_path)
    assert files.model == tmp_path / "model.pt" and files.marker == tmp_path / RUN_MARKER
    assert files.checkpoints == tmp_path / "checkpoints" and file_name("drift_reference") == "drift_reference.json"
    with pytest.raises(AttributeError, match="no file named 'modle'.*TABLE"):
        files.modle  # noqa: B018 - the attribute's error is the point


def test_what_a_replacing_run_deletes_follows_from_the_table():
    """Never the marker, the dataset, the bundle or the checkpoints by pattern (each has its own rule), never a
    stream job's state; every output of a batch run."""
    assert set(RUN_FILES) == {f.path for f in TABLE if f.kind == "replaced"}
    assert not {RUN_MARKER, "dataset", "bundle", "checkpoints", "feature-state", "trainer-status.json"} & set(RUN_FILES)
    assert {"model.pt", "linear.pt", "summary.json", "config.json", "metrics.jsonl", "report.html"} <= set(RUN_FILES)
    assert RUN_DIRS.index("workers/heartbeats") < RUN_DIRS.index("workers")  # removed deepest first


def test_a_prepared_run_ends_through_its_run_dir(tmp_path):
    run = prepare_run_dir(tmp_path / "done", {"input": "a.csv"})
    run.files.model.write_bytes(b"weights")
    run.complete()
    marker = read_marker(run.path)
    assert marker["status"] == "complete" and marker["files"] == ["model.pt"] and "pid" not in marker

    failed = prepare_run_dir(tmp_path / "failed", {"input": "a.csv"})
    failed.fail(ValueError("the label column is missing"))
    marker = read_marker(failed.path)
    assert marker["status"] == "failed" and marker["error"] == "ValueError: the label column is missing"
    again = prepare_run_dir(tmp_path / "failed", {"input": "b.csv"})  # the lock was let go, the failed run replaced
    assert again.run_id != failed.run_id and "replaced flowtrain's own failed run" in again.note
    again.release()


def test_the_stream_trainers_status_is_written_where_the_table_says(tmp_path):
    """The online trainer's status file (what the status page and the bench read), written whole with the time."""
    import json

    from flowtrain.train.stream.sinks import write_status

    write_status(tmp_path, {"step": 3, "version": 2, "status": "running"})
    got = json.loads(RunFiles(tmp_path).trainer_status.read_text())
    assert got["step"] == 3 and got["version"] == 2 and got["status"] == "running" and got["time"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["trainer-status.json"]  # no temporary left
