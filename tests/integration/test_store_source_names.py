"""Files read from an object store are named by their URL (h6 item 5): the batch ETL and predict download them,
and the dataset manifest's ``inputs``, the dead letters' sources and ``pred_source`` showed the temporary local
copy's name; now they record the URL the user gave. ``flowtrain.export`` returns a ``str`` whether ``out`` is
local or on an object store (it returned a Path for one, a str for the other). On fsspec's in-memory store."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest

import flowtrain
from connectors.dataset import read_manifest

pytestmark = pytest.mark.timeout(600)


def test_downloaded_inputs_are_recorded_by_their_url_and_export_returns_a_str(tmp_path):
    fs = fsspec.filesystem("memory")
    root = f"flowtrain-{uuid.uuid4().hex[:8]}"  # memory://ROOT/...
    rng = np.random.default_rng(0)
    rows = 120
    x, c = rng.normal(size=rows), rng.choice(["a", "b"], size=rows)
    lines = [f"{x[i]:.6f},{c[i]},{3 * x[i] + (c[i] == 'a'):.6f}\n" for i in range(rows)]
    lines[5] = "not-a-number,a,1.0\n"  # line 7 of the file: a dead letter naming its source
    fs.pipe_file(f"{root}/in/data.csv", ("x,c,y\n" + "".join(lines)).encode())
    url = f"memory://{root}/in/data.csv"
    glob = f"memory://{root}/in/dat*.csv"

    run = tmp_path / "run"
    flowtrain.batch(input=[glob], label="y", numeric=["x"], categorical=["c"], hidden=[8], batch_size=32, steps=2,
                    threads=1, no_progress=True, out=str(run))
    manifest = read_manifest(run / "dataset")
    assert manifest["inputs"] == [url]  # not /tmp/flowtrain-store-*/0-0/data.csv
    dead = [json.loads(line) for line in open(run / "dead_letters.jsonl")]
    assert [d["source"] for d in dead] == [f"{url}:7"], dead

    summary = flowtrain.predict(model=str(run), input=url, out=str(tmp_path / "p.parquet"))
    assert summary["inputs"] == [url]
    sources = pq.read_table(tmp_path / "p.parquet").column("pred_source").to_pylist()
    assert len(sources) == rows - 1 and all(s.startswith(f"{url}:") for s in sources), sources[:3]

    local = flowtrain.export(str(run), str(tmp_path / "bundle"))
    assert isinstance(local, str) and local == str(tmp_path / "bundle") and Path(local, "bundle.json").is_file()
    remote = flowtrain.export(str(run), f"memory://{root}/models/v1")
    assert remote == f"memory://{root}/models/v1" and fs.exists(f"{root}/models/v1/bundle.json")
    assert flowtrain.load(remote).predict([{"x": 0.5, "c": "a"}])[0]
