"""The tables of ``bench quality``: each available offline, with its split, metric and ``flowtrain batch`` options.

Real tables ship inside installed packages (scikit-learn's bundled tables, palmerpenguins, the default dataset
preset's demo events); generated tables have a known non-linear signal (scikit-learn's generators, fixed seeds). A table
writes its input once under the bench's work directory (``prepare``) and says how ``flowtrain batch`` reads it
(``args``). Random splits are flowtrain's own (80/10/10 by ``--seed``: each seed is another split); the
demo sample keeps the demo's time split (train January–September, validation October, test
November–December), so its seeds change only the model's initialization and batches.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyarrow import csv as pa_csv

from bench.demo import build_demo, demo, demo_inputs, hook
from flowtrain.local.runners import pipeline_options

#: The metric of each kind of label: AUC (binary), accuracy (K classes), RMSE (regression, the label's units).
METRICS = {"binary": "auc", "multiclass": "accuracy", "regression": "rmse"}


@dataclass(frozen=True)
class Table:
    name: str
    source: str  # where the rows come from
    kind: str  # binary, multiclass or regression
    split: str  # how it is split
    prepare: Callable[[Path, bool], list[str]]  # (work directory, tiny) -> flowtrain batch's data options

    @property
    def metric(self) -> str:
        return METRICS[self.kind]


def _csv(columns: dict, path: Path, label: str, categorical: tuple[str, ...] = (),
         optional: tuple[str, ...] = ()) -> list[str]:
    """``columns`` (name -> values) as a CSV file, and the ``flowtrain batch`` options that read it."""
    pa_csv.write_csv(pa.table({k: pa.array(list(v) if not isinstance(v, np.ndarray) else v) for k, v in columns.items()}),
                  path)
    numeric = [c for c in columns if c not in (label, *categorical, *optional)]
    args = ["--input", str(path), "--label", label]
    if numeric:
        args += ["--numeric", ",".join(numeric)]
    if optional:
        args += ["--optional-numeric", ",".join(optional)]
    if categorical:
        args += ["--categorical", ",".join(categorical)]
    return args


def _matrix(x: np.ndarray, names: list[str]) -> dict:
    return {n.replace(" ", "_").replace("(", "").replace(")", ""): x[:, i] for i, n in enumerate(names)}


def _bundled(loader_name: str, label: str):
    def prepare(work: Path, tiny: bool) -> list[str]:
        from sklearn import datasets

        raw = getattr(datasets, loader_name)()
        columns = _matrix(raw.data, list(raw.feature_names))
        columns[label] = np.asarray(raw.target_names)[raw.target]  # the class names
        return _csv(columns, work / f"{loader_name}.csv", label)
    return prepare


def _diabetes(work: Path, tiny: bool) -> list[str]:
    from sklearn import datasets

    raw = datasets.load_diabetes(scaled=False)
    columns = _matrix(raw.data, list(raw.feature_names))
    columns["sex"] = np.where(columns["sex"] == 1.0, "f", "m")
    columns["progression"] = raw.target
    return _csv(columns, work / "diabetes.csv", "progression", categorical=("sex",))


def _digits(work: Path, tiny: bool) -> list[str]:
    from sklearn import datasets

    raw = datasets.load_digits()
    columns = _matrix(raw.data, list(raw.feature_names))
    columns["digit"] = np.array([f"d{t}" for t in raw.target])  # class names, not a number to regress
    return _csv(columns, work / "digits.csv", "digit")


def _penguins(work: Path, tiny: bool) -> list[str]:
    from palmerpenguins import load_penguins

    frame = load_penguins().drop(columns=["year"])
    path = work / "penguins.csv"
    frame.to_csv(path, index=False)
    return ["--input", str(path), "--label", "species", "--categorical", "island,sex", "--optional-numeric",
            "bill_length_mm,bill_depth_mm,flipper_length_mm,body_mass_g"]


def _friedman1(work: Path, tiny: bool) -> list[str]:
    """y = 10 sin(pi x1 x2) + 20 (x3 - 1/2)^2 + 10 x4 + 5 x5 + N(0, 1); x6..x10 are noise."""
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=1_000 if tiny else 5_000, n_features=10, noise=1.0, random_state=0)
    columns = _matrix(x, [f"x{i + 1}" for i in range(10)])
    columns["y"] = y
    return _csv(columns, work / "friedman1.csv", "y")


def _hastie(work: Path, tiny: bool) -> list[str]:
    """Ten standard normals; positive when their sum of squares exceeds 9.34 (the chi-squared(10) median)."""
    from sklearn.datasets import make_hastie_10_2

    x, y = make_hastie_10_2(n_samples=1_000 if tiny else 6_000, random_state=0)
    columns = _matrix(x, [f"x{i + 1}" for i in range(10)])
    columns["outside"] = np.where(y > 0, "yes", "no")
    return _csv(columns, work / "hastie.csv", "outside")


def _shop(work: Path, tiny: bool) -> list[str]:
    """Generated baskets: a category decides the shape of a numeric's effect (a periodic hour-of-day curve per
    store type, a threshold on price per segment) plus a linear part and noise; the label is the spend."""
    rng = np.random.default_rng(0)
    n = 1_000 if tiny else 8_000
    stores, segments = np.array(["mall", "street", "online", "outlet"]), np.array(["new", "regular", "vip"])
    store = rng.integers(0, 4, n)
    segment = rng.choice(3, n, p=[0.5, 0.35, 0.15])
    hour = rng.uniform(0, 24, n)
    price = rng.lognormal(3, 0.6, n)
    items = rng.poisson(3, n).astype(float)
    curve = np.sin(2 * np.pi * hour / 24 + np.array([0.0, 2.0, 4.0, 1.0])[store])
    above = (price > np.array([15.0, 25.0, 40.0])[segment]).astype(float)
    spend = 20 * curve + 15 * above + 2 * items + 0.1 * price + rng.normal(0, 3, n)
    return _csv({"hour": hour, "price": price, "items": items, "store": stores[store], "segment": segments[segment],
                 "spend": spend}, work / "shop.csv", "spend", categorical=("store", "segment"))


def _demo_sample(work: Path, tiny: bool) -> list[str]:
    """Every 10th event of the default dataset preset (the demo; every 50th with --tiny), through the preset's own
    ETL (its joins and feature code, reached by its hooks: bench.demo); the run then trains on it (``--dataset``)."""
    import pyarrow.parquet as pq

    preset = demo()
    every = 50 if tiny else 10
    dataset = work / f"demo-every-{every}"
    if not (dataset / "_manifest.json").exists():
        inputs = demo_inputs(preset)
        events = hook(preset, "events_input", "quality")
        table = pq.read_table(inputs[events])
        sample = work / f"events-every-{every}.parquet"
        pq.write_table(table.take(pa.array(np.arange(0, table.num_rows, every))), sample)
        build_demo(preset, "quality", dataset_path=dataset, options=pipeline_options("batch"),
                   inputs={**inputs, events: str(sample)})
    return ["--dataset", str(dataset)]


TABLES: dict[str, Table] = {t.name: t for t in (
    Table("breast_cancer", "scikit-learn load_breast_cancer, 569 rows, 30 numerics", "binary", "random 80/10/10",
          _bundled("load_breast_cancer", "diagnosis")),
    Table("wine", "scikit-learn load_wine, 178 rows, 13 numerics", "multiclass", "random 80/10/10",
          _bundled("load_wine", "cultivar")),
    Table("diabetes", "scikit-learn load_diabetes (unscaled), 442 rows, 9 numerics + sex", "regression",
          "random 80/10/10", _diabetes),
    Table("digits", "scikit-learn load_digits, 1,797 rows, 64 pixel numerics, 10 classes", "multiclass",
          "random 80/10/10", _digits),
    Table("penguins", "palmerpenguins, 344 rows, 4 numerics with missing values + island, sex", "multiclass",
          "random 80/10/10", _penguins),
    Table("demo_sample", "the demo's events (the default dataset preset: every 10th, ~33k rows) through its own ETL "
          "and label (an arrival more than 15 minutes late)", "binary", "time: Jan-Sep / Oct / Nov-Dec",
          _demo_sample),
    Table("friedman1", "generated: make_friedman1, 5,000 rows, 10 numerics (5 pure noise), noise sd 1",
          "regression", "random 80/10/10", _friedman1),
    Table("hastie", "generated: make_hastie_10_2, 6,000 rows, 10 normals, label: sum of squares > 9.34", "binary",
          "random 80/10/10", _hastie),
    Table("shop", "generated: 8,000 baskets, hour-of-day curve per store type, price threshold per segment",
          "regression", "random 80/10/10", _shop),
)}

#: --tiny: a smoke test of every path (a K-class table, a regression with categoricals, a generated signal).
TINY = ("wine", "diabetes", "friedman1")
