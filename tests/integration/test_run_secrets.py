"""A run writes no secret: Beam options that hold one (an S3 secret key given to `flowtrain batch`) are
redacted in config.json, run.json and every other file under --out."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SECRET = "s3-" + "f00dfacecafe" * 2


def test_a_batch_run_with_a_secret_beam_option_writes_it_nowhere(tmp_path):
    from flowtrain.cli.main import main

    rng = np.random.default_rng(0)
    x = rng.normal(size=300)
    csv = tmp_path / "data.csv"
    csv.write_text("x,y\n" + "".join(f"{x[i]:.5f},{2 * x[i]:.5f}\n" for i in range(300)))
    out = tmp_path / "run"
    rc = main(["batch", "--input", str(csv), "--label", "y", "--task", "regression", "--numeric", "x", "--epochs", "1",
               "--threads", "1", "--no-progress", "--out", str(out),
               f"--beam-args=--s3_secret_access_key={SECRET}", "--beam-args=--s3_access_key_id=AKIAEXAMPLE"])
    assert rc == 0
    holding = [str(p) for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert holding == []
    config = json.loads((out / "config.json").read_text())
    assert "--s3_secret_access_key=<redacted>" in config["beam_args"]
    assert "--s3_access_key_id=AKIAEXAMPLE" in config["beam_args"]  # not a secret: kept
    marker = json.loads((out / "run.json").read_text())
    assert "--s3_secret_access_key=<redacted>" in marker["options"]["beam_args"]
    # the same options again with --resume: the redacted record still matches them
    rc = main(["batch", "--input", str(csv), "--label", "y", "--task", "regression", "--numeric", "x", "--epochs", "1",
               "--threads", "1", "--no-progress", "--out", str(out), "--resume",
               f"--beam-args=--s3_secret_access_key={SECRET}", "--beam-args=--s3_access_key_id=AKIAEXAMPLE"])
    assert rc == 0
    assert not [p for p in Path(out).rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
