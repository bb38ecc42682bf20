"""A dataset directory is replaced only when flowtrain provably wrote it (#22 item 1), and a
manifest's shard paths never leave the dataset directory (#22 item 14)."""
from __future__ import annotations

import json

import apache_beam as beam
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from connectors.dataset import MANIFEST, DatasetError, WriteDataset, read_manifest, shard_paths
from flowtrain.local.runners import pipeline_options

pytestmark = pytest.mark.timeout(180)


def _batch(lo: int, hi: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"x": [float(i) for i in range(lo, hi)]})


def _write(path, pairs, **kwargs) -> None:
    with beam.Pipeline(options=pipeline_options("batch")) as p:
        _ = p | beam.Create(pairs) | WriteDataset(str(path), **kwargs)


def _user_files(ds):
    (ds / "sub").mkdir(parents=True)
    (ds / "notes.txt").write_text("my notes")
    (ds / "sub" / "data.csv").write_text("a,b\n1,2\n")


def test_overwrite_refuses_a_directory_holding_files_flowtrain_did_not_write(tmp_path):
    ds = tmp_path / "dataset"
    _user_files(ds)
    with pytest.raises(DatasetError, match=rf"{ds} is not empty and holds no {MANIFEST} \(notes.txt, sub/data.csv\)"):
        _write(ds, [("train", _batch(0, 10))], overwrite=True)
    assert (ds / "notes.txt").read_text() == "my notes" and (ds / "sub" / "data.csv").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]  # no staging left, nothing renamed


def test_overwrite_refuses_a_flowtrain_dataset_that_also_holds_a_users_file(tmp_path):
    ds = tmp_path / "dataset"
    _write(ds, [("train", _batch(0, 10))])
    (ds / "train" / "mine.parquet").write_text("not a shard of ours")
    (ds / "README").write_text("keep me")
    with pytest.raises(DatasetError, match=r"holds files its _manifest.json does not name \(README, "
                                           r"train/mine.parquet\)"):
        _write(ds, [("train", _batch(0, 20))], overwrite=True)
    assert (ds / "README").exists() and (ds / "train" / "mine.parquet").exists()
    assert read_manifest(ds)["rows"] == {"train": 10}  # the old dataset is untouched


def test_overwrite_replaces_a_dataset_flowtrain_wrote_and_deletes_only_its_files(tmp_path):
    ds = tmp_path / "dataset"
    _write(ds, [("train", _batch(0, 10)), ("test", _batch(10, 15))])
    old = shard_paths(ds, "train") + shard_paths(ds, "test")
    _write(ds, [("train", _batch(0, 30))], overwrite=True)
    assert read_manifest(ds)["rows"] == {"train": 30}
    assert not any(__import__("os").path.exists(p) for p in old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]  # the old copy is gone, all of it


def test_the_tabular_etl_never_deletes_a_users_files_in_its_dataset_path(tmp_path):
    """The probe of the issue: a run into a directory holding a user's files used to exit 0 with them gone."""
    from connectors.dataset_spec import FeatureSpec
    from pipelines.tabular.pipeline import run_tabular_etl

    table = pa.table({"x": [float(i) for i in range(200)], "y": [float(i % 7) for i in range(200)]})
    pacsv.write_csv(table, tmp_path / "in.csv")
    ds = tmp_path / "run" / "dataset"
    _user_files(ds)
    with pytest.raises(DatasetError, match=str(ds)):
        run_tabular_etl([str(tmp_path / "in.csv")], FeatureSpec(label="y", numeric=["x"]), dataset_path=str(ds),
                        dead_letters_path=str(tmp_path / "run" / "dead.jsonl"), options=pipeline_options("batch"))
    assert (ds / "notes.txt").read_text() == "my notes" and (ds / "sub" / "data.csv").read_text() == "a,b\n1,2\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["dataset"]


def test_remove_dataset_deletes_only_a_dataset_flowtrain_wrote(tmp_path):
    from connectors.dataset import remove_dataset

    ds = tmp_path / "ds"
    _write(ds, [("train", _batch(0, 10))])
    (ds / "extra.txt").write_text("x")
    with pytest.raises(DatasetError, match="extra.txt"):
        remove_dataset(ds)
    assert read_manifest(ds)["rows"] == {"train": 10}
    (ds / "extra.txt").unlink()
    removed = remove_dataset(ds)
    assert removed[0] == MANIFEST and not ds.exists()


@pytest.mark.parametrize("bad", ["../outside.parquet", "train/../../outside.parquet", "/etc/passwd",
                                 "file:///etc/passwd", "gs://bucket/x.parquet"])
def test_a_manifest_naming_a_shard_outside_the_dataset_is_refused_naming_the_manifest(tmp_path, bad):
    ds = tmp_path / "ds"
    _write(ds, [("train", _batch(0, 10))])
    manifest = json.loads((ds / MANIFEST).read_text())
    manifest["splits"]["train"].append({"file": bad, "rows": 1})
    (ds / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=rf"{ds / MANIFEST} lists shard '{bad}', which is not a relative path"):
        shard_paths(ds, "train")
    from connectors.dataset import remove_dataset

    with pytest.raises(DatasetError, match="not a relative path"):
        remove_dataset(ds)  # nothing outside is ever deleted either
    assert (ds / MANIFEST).exists()
