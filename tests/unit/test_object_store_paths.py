"""Issue 33 item 4, first part: a URL whose scheme has no installed filesystem is a one-line error naming the
scheme and the extra to install, for every path option; never a local folder named ``gs:``."""
from __future__ import annotations

import subprocess
import sys

import pytest

import flowtrain
from connectors.fields import OptionError
from connectors.paths import StoreError, check_path, is_url, url_scheme


def test_item4_url_scheme_and_local_paths():
    assert url_scheme("gs://b/runs/a") == "gs"
    assert url_scheme("AZ://c/x") == "az"
    assert url_scheme("file:///tmp/x") is None and url_scheme("/tmp/gs:/x") is None and url_scheme("runs/a") is None
    assert url_scheme(r"C:\runs\a") is None
    assert is_url("s3://b/k") and not is_url("runs/a")
    assert check_path("runs/a", "--out") == "runs/a"


def test_item4_uninstalled_scheme_names_the_extra():
    with pytest.raises(StoreError, match=r"--out gs://b/r: no filesystem for gs:// is installed; pip install "
                                         r"'flowtrain\[gcs\]' \(gcsfs\)"):
        check_path("gs://b/r", "--out")
    with pytest.raises(StoreError, match=r"flowtrain\[s3\]"):
        check_path("s3://b/r", "--model")
    with pytest.raises(StoreError, match=r"nosuch:// is not a filesystem flowtrain knows"):
        check_path("nosuch://b/r", "--out")
    assert check_path("az://c/r", "--out") == "az://c/r"  # adlfs: a test dependency (flowtrain[azure])
    with pytest.raises(StoreError, match="takes a local"):
        check_path("az://c/r", "--out", remote=False)


@pytest.mark.parametrize("call", [
    lambda: flowtrain.batch(out="gs://my-bucket/runs/a", steps=1),
    lambda: flowtrain.batch(dataset="gs://my-bucket/ds", out="runs/x"),
    lambda: flowtrain.batch(input=["gs://my-bucket/t.csv"], label="y", out="runs/x"),
    lambda: flowtrain.predict(model="gs://my-bucket/runs/a", input=["x.csv"], out="p.parquet"),
    lambda: flowtrain.predict(model="runs/a", input=["x.csv"], out="s3://b/p.parquet"),
    lambda: flowtrain.predict(model="runs/a", input=["x.csv"], out="p.parquet", dead_letters="gs://b/dl.jsonl"),
    lambda: flowtrain.export("runs/a", "s3://b/bundle"),
    lambda: flowtrain.export("gs://b/runs/a", "bundle"),
])
def test_item4_python_api_refuses_uninstalled_scheme(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptionError, match=r"no filesystem for (gs|s3):// is installed; pip install 'flowtrain\["):
        call()
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*")), "a local folder named after the scheme"


@pytest.mark.parametrize("argv", [
    ["batch", "--out", "gs://my-bucket/runs/a"],
    ["predict", "--model", "runs/a", "--input", "x.csv", "--out", "gs://b/p.parquet"],
    ["export", "runs/a", "--out", "s3://b/bundle"],
    ["stream", "train", "--init-weights", "gs://b/model.pt"],
])
def test_item4_cli_refuses_uninstalled_scheme(argv, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli.main", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "no filesystem for" in last and "pip install" in last or "takes a local" in last, proc.stderr
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))


def test_item4_job_only_needs_a_shared_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(flowtrain.FlowtrainError, match="--job-only: --out az://box/runs/a is on an object store"):
        flowtrain.batch(out="az://box/runs/a", job_only=True)


def test_item4_store_without_credentials_is_one_line(tmp_path, monkeypatch):
    """An installed filesystem without credentials in the environment: one line naming --out, the URL and
    where credentials come from; nothing written locally."""
    import os

    import fsspec

    for name in [n for n in os.environ if n.startswith("AZURE_STORAGE_")]:
        monkeypatch.delenv(name)
    # fsspec keeps one filesystem per class and arguments for the process: one an earlier test made with
    # Azurite's connection string in the environment would otherwise be reused here
    az = fsspec.get_filesystem_class("az")
    monkeypatch.setattr(az, "_cache", {})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(flowtrain.FlowtrainError) as err:
        flowtrain.batch(out="az://box/runs/a", input=["x.csv"], label="y")
    text = str(err.value)
    assert "\n" not in text and text.startswith("--out az://box/runs/a: opening the filesystem failed") and \
        "credentials in the environment" in text, text
    assert not list(tmp_path.iterdir())
