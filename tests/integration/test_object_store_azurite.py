"""Issue 33 item 4: object storage for every path, end to end against a real object-store server on loopback
(Azurite's blob service, the session fixture ``azurite``; adlfs's ``az://``): ``flowtrain batch`` with its input
and ``--out`` there, ``flowtrain predict --model`` from there, ``flowtrain.load`` from there, a resume from a
checkpoint there; the run-directory rules hold there (write-then-mark; nothing of others deleted)."""
from __future__ import annotations

import json
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest

import flowtrain
from flowtrain.cli.main import main

TRAIN = ["--label", "y", "--task", "regression", "--numeric", "x", "--categorical", "c", "--hidden", "8",
         "--batch-size", "32", "--eval-every", "2", "--decay-steps", "8", "--threads", "1", "--no-progress"]


@pytest.fixture()
def store(azurite):
    import fsspec

    fs = fsspec.filesystem("az", skip_instance_cache=True, connection_string=azurite.connection_string)
    container = f"flowtrain-{uuid.uuid4().hex[:12]}"
    fs.mkdir(container)
    return fs, container


def _json(fs, key):
    return json.loads(fs.cat_file(key))


def test_item4_batch_predict_load_resume_on_azurite(store, tmp_path, monkeypatch, capsys):
    fs, box = store
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    rows = 240
    x, c = rng.normal(size=rows), rng.choice(["a", "b"], size=rows)
    y = 3 * x + 2 * (c == "a") + rng.normal(scale=0.1, size=rows)
    fs.pipe_file(f"{box}/in/data.csv",
                 ("x,c,y\n" + "".join(f"{x[i]:.6f},{c[i]},{y[i]:.6f}\n" for i in range(rows))).encode())
    run = f"az://{box}/runs/a"

    # batch: input and --out on the object store
    assert main(["batch", "--input", f"az://{box}/in/data.csv", *TRAIN, "--steps", "4", "--out", run]) == 0
    marker = _json(fs, f"{box}/runs/a/run.json")
    assert marker["status"] == "complete" and "model.pt" in marker["files"]
    for key in ("model.pt", "config.json", "summary.json", "report.md", "dataset/_manifest.json",
                "bundle/bundle.json", "checkpoints/ckpt-000000004.pt", "checkpoints/ckpt-000000004.sha256"):
        assert fs.exists(f"{box}/runs/a/{key}"), key
    assert _json(fs, f"{box}/runs/a/config.json")["out"] == run
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*")), "a local folder named after the scheme"

    # predict --model from there, its input and --out there too
    out = f"az://{box}/preds/p.parquet"
    assert main(["predict", "--model", run, "--input", f"az://{box}/in/data.csv", "--out", out]) == 0
    with fs.open(f"{box}/preds/p.parquet", "rb") as fh:
        predicted = pq.read_table(fh)
    assert predicted.num_rows == rows
    assert _json(fs, f"{box}/preds/p.parquet.metrics.json")["counts"]["predictions"] == rows
    assert fs.exists(f"{box}/preds/p.parquet.dead_letters.jsonl")
    # an existing output is never replaced without --overwrite
    assert main(["predict", "--model", run, "--input", f"az://{box}/in/data.csv", "--out", out]) == 2

    # flowtrain.load from there: the same predictions as flowtrain predict
    predictor = flowtrain.load(f"{run}/bundle")
    mine = predictor.predict([{"x": float(f"{x[i]:.6f}"), "c": str(c[i])} for i in range(rows)])  # as in the CSV
    value = [n for n in predicted.column_names if n.startswith("pred_") and n not in
             ("pred_source", "pred_model_version")][0]
    np.testing.assert_allclose([r[value] for r in mine], predicted.column(value).to_numpy(), atol=1e-6)

    # export from there to there: the bundle published, bundle.json after the files it lists; it loads
    assert main(["export", run, "--out", f"az://{box}/models/v1"]) == 0
    assert fs.exists(f"{box}/models/v1/bundle.json")
    exported = flowtrain.load(f"az://{box}/models/v1").predict([{"x": float(f"{x[0]:.6f}"), "c": str(c[0])}])
    assert abs(exported[0][value] - mine[0][value]) <= 1e-6
    assert main(["export", run, "--out", f"az://{box}/models/v1"]) == 2  # exists: only with --overwrite
    assert main(["export", run, "--out", f"az://{box}/models/v1", "--overwrite"]) == 0  # flowtrain's: replaced
    assert fs.exists(f"{box}/models/v1/bundle.json")

    # --dataset there: another run trains on the first run's dataset, read from the store
    assert main(["batch", "--dataset", f"{run}/dataset", "--hidden", "8", "--batch-size", "32", "--steps", "2",
                 "--threads", "1", "--no-progress", "--out", f"az://{box}/runs/b"]) == 0
    assert _json(fs, f"{box}/runs/b/run.json")["status"] == "complete"
    assert fs.exists(f"{box}/runs/b/bundle/bundle.json") and not fs.exists(f"{box}/runs/b/dataset/_manifest.json")

    # resume from the checkpoint there: downloaded, its checksum verified, the same run continued
    capsys.readouterr()
    assert main(["batch", "--input", f"az://{box}/in/data.csv", *TRAIN, "--steps", "8", "--out", run,
                 "--resume"]) == 0
    assert "resumed from ckpt-000000004.pt (step 4)" in capsys.readouterr().out
    again = _json(fs, f"{box}/runs/a/run.json")
    assert again["status"] == "complete" and again["run_id"] == marker["run_id"]
    assert fs.exists(f"{box}/runs/a/checkpoints/ckpt-000000008.pt")

    # a checkpoint damaged on the store: the resume refuses it (checksum), and the store is left as it was
    for key in fs.find(f"{box}/runs/a/checkpoints"):
        if key.endswith(".pt"):
            fs.pipe_file(key, b"not a checkpoint")
    assert main(["batch", "--input", f"az://{box}/in/data.csv", *TRAIN, "--steps", "9", "--out", run,
                 "--resume"]) == 2
    assert "checksum" in capsys.readouterr().err
    assert _json(fs, f"{box}/runs/a/run.json")["status"] == "complete"


def test_item4_foreign_object_store_folder_is_not_ours(store, tmp_path, monkeypatch, capsys):
    fs, box = store
    monkeypatch.chdir(tmp_path)
    fs.pipe_file(f"{box}/theirs/notes.txt", b"not flowtrain's")
    fs.pipe_file(f"{box}/in/data.csv", b"x,c,y\n1,a,2\n")
    assert main(["batch", "--input", f"az://{box}/in/data.csv", *TRAIN, "--steps", "2", "--out",
                 f"az://{box}/theirs", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"az://{box}/theirs is not empty" in err and "flowtrain-stage" not in err, err
    assert fs.cat_file(f"{box}/theirs/notes.txt") == b"not flowtrain's"
    assert not fs.exists(f"{box}/theirs/run.json")


def test_item4_beam_azfs_form_reaches_the_same_store(store):
    """``azfs://ACCOUNT/CONTAINER/PATH`` (Beam's form) is the same blob as ``az://CONTAINER/PATH``."""
    from flowtrain.local.azurite import DEV_ACCOUNT
    from flowtrain.train.staging import fetch_inputs

    fs, box = store
    fs.pipe_file(f"{box}/in/one.csv", b"x\n1\n")
    (local,) = fetch_inputs([f"azfs://{DEV_ACCOUNT}/{box}/in/one.csv"])
    assert open(local, "rb").read() == b"x\n1\n"


def test_item4_azurite_listens_on_loopback_only(azurite):
    """docs/security.md: Azurite's blob service is the one listener, on 127.0.0.1."""
    from tests.procs import is_loopback, listening_sockets

    pid = azurite.running_pid()
    assert pid is not None
    held = listening_sockets([pid])[pid]
    assert held and all(is_loopback(addr) for addr, _ in held), held
    assert {port for _, port in held} == {azurite.port}, held
