"""Issue 44 item 4: a forged bundle's ID tables cannot make ``flowtrain.load`` allocate without bound. A resealed
unsigned bundle whose ID table config said capacity 1e9 tried to allocate 64 GB (dim 1e8: 409 GB), a NaN
capacity gave a raw ``ValueError``: ``build_module`` left ``.table.`` tensors out of its shape check. Each forged
bundle here is a real bundle (``write_bundle`` of a trained model with an ID table) with one field changed and
its bundle.json resealed; each is loaded in a subprocess capped at 6 GiB of address space, so a regression is
a failed test, not a machine out of memory."""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from connectors.atomic import file_sha256
from connectors.dataset_spec import FeatureSpec
from connectors.id_keys import key_of
from flowtrain.train.models import Architecture

CAP = 6 << 30  # address space of the loading process (torch's import alone maps ~3.2 GB)


def _data():
    spec = FeatureSpec(label="y", task="classification", numeric=["a"], id_columns=["user"])
    return SimpleNamespace(spec=spec, n_numeric=1, cardinalities=[], outputs=1, classes=["0", "1"],
                           stats={"numeric": {"a": {"mean": 0.0, "std": 1.0}}, "classes": ["0", "1"]},
                           kind="classification")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A bundle of a wide-and-deep model with a 4-wide ID table holding 12 IDs (some expired: free rows)."""
    from flowtrain.train.bundle import write_bundle
    from flowtrain.train.ids import IdTable

    torch.manual_seed(0)
    model = Architecture("mlp", (8,), 0.0, 0, "test", id_dim=4).build(_data())
    model.ids["0"].table = IdTable(4, ttl=20, init_std=0.05)
    model.train()
    for step in range(6):
        keys = torch.as_tensor([key_of(f"u{u + 3 * step}") for u in range(6)])[:, None]
        model(torch.zeros(6, 1), keys).sum().backward()
        model.id_step(6, 0.01)
    model.eval()
    out = tmp_path_factory.mktemp("bundles") / "good"
    write_bundle(out, model, _data(), SimpleNamespace(hidden=(8,), dropout=0.0))
    return out


def _reseal(path) -> None:
    """bundle.json's checksums and sizes made to fit the files again (an unsigned bundle: anyone can)."""
    manifest = json.loads((path / "bundle.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = file_sha256(path / name)
        manifest["bytes"][name] = (path / name).stat().st_size
    manifest["sha256"] = manifest["files"]["weights.safetensors"]
    (path / "bundle.json").write_text(json.dumps(manifest))


def _forge(bundle, tmp_path, name: str, *, config: dict | None = None, model: dict | None = None,
           tensors: dict | None = None):
    """A copy of ``bundle`` with its table's config fields, model.json's architecture fields or tensors changed."""
    from flowtrain.train.bundle_tables import CONFIG_FIELDS

    path = tmp_path / name
    shutil.copytree(bundle, path)
    if config or tensors:
        state = load_file(str(path / "weights.safetensors"))
        if config:
            values = state["ids.0.table.config"].tolist()
            for field, value in config.items():
                values[CONFIG_FIELDS.index(field)] = value
            state["ids.0.table.config"] = torch.tensor(values, dtype=torch.float64)
        state.update(tensors or {})
        save_file(state, str(path / "weights.safetensors"))
    if model:
        doc = json.loads((path / "model.json").read_text())
        doc["architecture"].update(model)
        (path / "model.json").write_text(json.dumps(doc))
    _reseal(path)
    return path


def _load_all(paths) -> list[str]:
    """Each bundle loaded by ``flowtrain.load`` in one capped subprocess: "ok" or the error's type and line."""
    script = textwrap.dedent("""
        import json, sys
        import flowtrain
        out = []
        for path in sys.argv[1:]:
            try:
                flowtrain.load(path)
                out.append("ok")
            except Exception as err:
                out.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        print(json.dumps(out))
    """)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    proc = subprocess.run([sys.executable, "-c", script, *map(str, paths)], capture_output=True, text=True,
                          timeout=300, preexec_fn=cap, cwd=os.getcwd())
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_item4_forged_id_tables_are_refused_in_one_line_before_anything_is_allocated(bundle, tmp_path):
    from flowtrain.train.bundle_tables import CONFIG_FIELDS, MAX_START_ELEMENTS

    good = load_file(str(bundle / "weights.safetensors"))
    config = dict(zip(CONFIG_FIELDS, good["ids.0.table.config"].tolist()))
    rows, free = len(good["ids.0.table.rows"]), len(good["ids.0.table.free"])
    assert free > 0 and config["capacity"] == rows + free  # expired IDs left free rows
    weights = "weights.safetensors"
    cases = {  # name: (forgery, what the one line says)
        "capacity": (dict(config={"capacity": 1e9}),
                     f"{weights}: ID table ids.0: config 'capacity' 1,000,000,000 is not its {rows} rows and {free} "
                     f"free rows"),
        "dim": (dict(config={"dim": 1e8}), f"{weights}: ID table ids.0: config 'dim' 100,000,000 does not fit its "
                                           f"weight [{rows}, 4]"),
        "nan": (dict(config={"capacity": math.nan}), "config 'capacity' is nan, not a whole number"),
        "wide weight": (dict(config={"dim": 8}, tensors={"ids.0.table.weight": torch.zeros(rows, 8)}),
                        "config 'dim' 8 is not model.json's id_dim 4"),
        "model.json capacity": (dict(model={"table": {"capacity": 1e9}}),
                                "model.json: ID tables that start with 1,000,000,000 rows of id_dim 4"),
        "model.json id_dim": (dict(model={"id_dim": 1 << 23}), "config 'dim' 4 is not model.json's id_dim 8388608"),
        "model.json option": (dict(model={"table": {"min_count": 0}}), "'min_count' is 0: out of its range"),
        "model.json unknown": (dict(model={"table": {"rows": 5}}), "'rows' is 5: not an option of an ID table"),
        "model.json start": (dict(model={"table": {"capacity": MAX_START_ELEMENTS}}),
                             f"ID tables that start with {MAX_START_ELEMENTS:,} rows of id_dim 4"),
    }
    paths = [_forge(bundle, tmp_path, name.replace(" ", "_"), **forgery) for name, (forgery, _) in cases.items()]
    got = _load_all([bundle, *paths])
    assert got[0] == "ok"
    for (name, (_, line)), answer in zip(cases.items(), got[1:]):
        assert answer.startswith("BundleError: ") and line in answer and answer.endswith("export the bundle again"), \
            (name, answer)
