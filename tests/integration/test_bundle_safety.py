"""Bundles are safe to load and to replace (#28 items 5, 8, 14; #29 item 9): loading imports no code unless
trusted, sizes come from the weights and are bounded before any allocation, signatures are verified with a
bundle key, bundle.json is checked field by field and sizes before hashing, --overwrite replaces only a bundle
flowtrain wrote, and exported bundles are readable under the user's umask."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import flowtrain
from flowtrain.errors import BundleError

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
KEY = b"bundle-test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def run(shared_data) -> Path:
    return shared_data.regression_run(hidden="8", epochs=1, rows=400)[1]  # read only: a test that changes it copies it


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run / "bundle", dest)
    return dest


def _reseal(bundle: Path) -> None:
    """What a forger does: recompute bundle.json's checksums and sizes after changing files (keeping the rest)."""
    manifest = json.loads((bundle / "bundle.json").read_text())
    for name in manifest["files"]:
        data = (bundle / name).read_bytes()
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
        manifest.setdefault("bytes", {})[name] = len(data)
    manifest["sha256"] = manifest["files"]["weights.safetensors"]
    (bundle / "bundle.json").write_text(json.dumps(manifest))


def _edit_model(bundle: Path, **arch) -> None:
    model = json.loads((bundle / "model.json").read_text())
    model["architecture"] = arch
    (bundle / "model.json").write_text(json.dumps(model))
    _reseal(bundle)


def _key(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "bundle.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(mode)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", *args], capture_output=True, text=True,
                          timeout=180, cwd=ROOT)


# --- item 5: --overwrite replaces only a bundle flowtrain wrote --------------------------------------------------
def test_export_overwrite_never_deletes_a_directory_that_is_not_a_flowtrain_bundle(run, tmp_path):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "sub" / "data.csv").write_text("a,b\n")
    with pytest.raises(flowtrain.FlowtrainError, match=r"is not a bundle flowtrain wrote .*sub, thesis.tex"):
        flowtrain.export(str(run), str(mine), overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work" and (mine / "sub" / "data.csv").exists()
    # a bundle of ours with a user's file added: refused too, nothing touched
    ours = _copy(run, tmp_path / "ours")
    (ours / "notes.md").write_text("mine")
    with pytest.raises(flowtrain.FlowtrainError, match=r"does not list \(notes.md\)"):
        flowtrain.export(str(run), str(ours), overwrite=True)
    assert (ours / "notes.md").exists() and (ours / "bundle.json").exists()
    # a link at --out is never followed
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(flowtrain.FlowtrainError, match="is a symbolic link"):
        flowtrain.export(str(run), str(link), overwrite=True)
    assert (mine / "thesis.tex").exists() and link.is_symlink()
    # a bundle flowtrain wrote is replaced
    (ours / "notes.md").unlink()
    assert flowtrain.export(str(run), str(ours), overwrite=True) == str(ours)  # a str, local or a URL
    flowtrain.load(str(ours))


# --- item 8: no code, bounded shapes, signatures ----------------------------------------------------------------
def test_loading_a_bundle_that_names_a_factory_imports_nothing_without_trust_code(run, tmp_path, monkeypatch):
    ran = tmp_path / "evilmod-ran"
    (tmp_path / "evilmod.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n\ndef build(spec):\n    raise "
                                         f"SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = _copy(run, tmp_path / "bundle")
    _edit_model(bundle, kind="factory", factory="evilmod:build")
    with pytest.raises(BundleError, match=r"the model is code \(factory 'evilmod:build'\).*trust_code=True"):
        flowtrain.load(str(bundle))
    (tmp_path / "rows.csv").write_text("x,c\n0.5,a\n")
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "predict", "--model", str(bundle), "--input",
                           str(tmp_path / "rows.csv"), "--out", str(tmp_path / "p.parquet")], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2 and "--trust-code" in proc.stderr, proc.stderr[-2000:]
    assert not ran.exists()  # the module was never imported
    # a kind that is not built in is named, never imported
    _edit_model(bundle, kind="evilmod:build")
    with pytest.raises(BundleError, match="unknown model kind 'evilmod:build'"):
        flowtrain.load(str(bundle))
    assert not ran.exists()


@pytest.mark.parametrize("hidden", [[1e9, 1e9], [4_000_000, 4_000_000], [1 << 30]])
def test_huge_hidden_sizes_in_model_json_are_refused_before_any_allocation(run, tmp_path, hidden):
    """hidden [1e9, 1e9] once allocated until the kernel killed the process; [4e6, 4e6] would be 64 TB."""
    bundle = _copy(run, tmp_path / "bundle")
    _edit_model(bundle, kind="mlp", hidden=hidden, dropout=0.0)
    with pytest.raises(BundleError, match="model.json"):
        flowtrain.load(str(bundle))


def test_a_bundle_resealed_after_flipping_weights_is_refused_with_the_bundle_key(run, tmp_path):
    key = _key(tmp_path)
    signed = Path(flowtrain.export(str(run), str(tmp_path / "signed"), bundle_key_file=str(key)))
    manifest = json.loads((signed / "bundle.json").read_text())
    assert len(manifest["signature"]) == 64
    flowtrain.load(str(signed), bundle_key_file=str(key))  # verifies
    weights = signed / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    _reseal(signed)  # checksums and sizes fit again: without a key it loads, which is what a key is for
    flowtrain.load(str(signed))
    with pytest.raises(BundleError, match="bad signature: not signed with this bundle key"):
        flowtrain.load(str(signed), bundle_key_file=str(key))
    proc = _cli("predict", "--model", str(signed), "--bundle-key-file", str(key), "--input", str(run.parent /
                "data.csv"), "--out", str(tmp_path / "p.parquet"))
    assert proc.returncode == 2 and "bad signature" in proc.stderr, proc.stderr[-2000:]
    # an unsigned bundle while a key is set: refused, saying so
    with pytest.raises(BundleError, match="the bundle is not signed, and a bundle key is set"):
        flowtrain.load(str(run / "bundle"), bundle_key_file=str(key))


# --- item 14: keys, bundle.json, sizes --------------------------------------------------------------------------
def test_a_key_file_its_group_or_others_can_read_is_refused_naming_its_mode(run, tmp_path):
    key = _key(tmp_path, 0o644)
    with pytest.raises(flowtrain.FlowtrainError, match=r"--bundle-key-file .*bundle.key: mode 0644 lets its group "
                                                       r"and others read .* `chmod 600"):
        flowtrain.export(str(run), str(tmp_path / "b"), bundle_key_file=str(key))
    assert not (tmp_path / "b").exists()
    from connectors.model_updates import UpdateKeySource

    with pytest.raises(ValueError, match=r"--update-key-file .*bundle.key: mode 0644"):
        UpdateKeySource.from_options(str(key)).load()
    key.chmod(0o600)
    assert UpdateKeySource.from_options(str(key)).load() == KEY


@pytest.mark.parametrize("change, message", [
    ({"format": "1"}, "'format' is '1', not a bundle format number"),
    ({"files": ["weights.safetensors"]}, "'files' must map file names to SHA-256 hex digests"),
    ({"files": {"weights.safetensors": 7}}, "'files' must map file names to SHA-256 hex digests"),
    ({"bytes": {"weights.safetensors": "big"}}, "'bytes' must map file names to sizes"),
    ({"run": ["x"]}, "'run' must be a string"),
])
def test_a_malformed_bundle_json_is_a_one_line_error(run, tmp_path, change, message):
    bundle = _copy(run, tmp_path / "bundle")
    manifest = json.loads((bundle / "bundle.json").read_text())
    (bundle / "bundle.json").write_text(json.dumps({**manifest, **change}))
    with pytest.raises(BundleError, match=message) as info:
        flowtrain.load(str(bundle))
    assert "\n" not in str(info.value)
    (bundle / "bundle.json").write_text("[1, 2]")
    with pytest.raises(BundleError, match="not a JSON object"):
        flowtrain.load(str(bundle))


def test_file_sizes_are_checked_against_bundle_json_before_any_hashing(run, tmp_path, monkeypatch):
    from flowtrain.train import bundle as bundle_module

    bundle = _copy(run, tmp_path / "bundle")
    with open(bundle / "features.json", "ab") as fh:
        fh.write(b" " * 4096)

    def no_hashing(path):
        raise AssertionError(f"hashed {path} before checking sizes")

    monkeypatch.setattr(bundle_module, "file_sha256", no_hashing)
    with pytest.raises(BundleError, match=r"features.json: [\d,]+ bytes, bundle.json says [\d,]+"):
        flowtrain.load(str(bundle))


# --- #29 item 9: permissions ------------------------------------------------------------------------------------
def test_exported_bundles_are_0755_and_0644_under_the_users_umask(run, tmp_path):
    old = os.umask(0o022)
    try:
        out = Path(flowtrain.export(str(run), str(tmp_path / "shared")))
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        name: 0o644 for name in ("weights.safetensors", "model.json", "features.json", "drift_reference.json",
                                 "bundle.json")}
    assert stat.S_IMODE((run / "bundle").stat().st_mode) & 0o755 == 0o755  # the run's own bundle too
    old = os.umask(0o077)
    try:
        private = Path(flowtrain.export(str(run), str(tmp_path / "private")))
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in private.iterdir()} == {0o600}


def test_a_trusted_factory_bundle_predicts_through_the_workers_and_batch_signs_its_bundle(run, tmp_path):
    """--trust-code reaches the loader on every Beam worker; `batch --bundle-key-file` signs <run>/bundle."""
    bundle = _copy(run, tmp_path / "bundle")
    arch = json.loads((bundle / "model.json").read_text())["architecture"]  # the default recipe's, whatever it chose
    (tmp_path / "mymlp.py").write_text(
        "from flowtrain.train.models import tabular_mlp\n\n\ndef build(spec):\n"
        f"    return tabular_mlp(spec, [8], 0.0, ensemble={arch.get('ensemble', 1)}, "
        f"numeric_embedding={arch.get('numeric_embedding', 0)})\n")
    _edit_model(bundle, kind="factory", factory="mymlp:build")  # the same weights, now behind a factory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    args = [sys.executable, "-m", "flowtrain.cli", "predict", "--model", str(bundle), "--input",
            str(run.parent / "data.csv"), "--out"]
    proc = subprocess.run([*args, str(tmp_path / "p.parquet"), "--trust-code"], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "p.parquet").num_rows == 400
    key = _key(tmp_path)
    from flowtrain.cli.main import main

    assert main(["batch", "--dataset", str(run / "dataset"), "--out", str(tmp_path / "signed"), "--hidden", "8",
                 "--epochs", "1", "--threads", "1", "--no-progress", "--bundle-key-file", str(key)]) == 0
    flowtrain.load(str(tmp_path / "signed"), bundle_key_file=str(key))
    assert "signature" in json.loads((tmp_path / "signed" / "bundle" / "bundle.json").read_text())


def test_predict_metrics_json_is_written_whole_and_synced_before_it_replaces_the_old_one(run, tmp_path, monkeypatch):
    """#28 item 10: `<out>.metrics.json` goes through the atomic writer (tmp, fsync, rename): a crash before the
    new file is on disk leaves the old outputs as they were."""
    out = tmp_path / "p.parquet"
    flowtrain.predict(model=str(run), input=[str(run.parent / "data.csv")], out=str(out))
    metrics = out.with_name(out.name + ".metrics.json")
    before = metrics.read_text()

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        flowtrain.predict(model=str(run), input=[str(run.parent / "data.csv")], out=str(out), overwrite=True)
    monkeypatch.undo()
    assert metrics.read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial left
