"""bench quality: what flowtrain's default model learns, against its linear start and gradient-boosted trees.

For each table of ``bench.quality_tables`` (scikit-learn's bundled tables, palmerpenguins, a sample of the demo's
events, generated tables with a known non-linear signal; each with its split and metric) and each ``--seeds``
seed, in the same run:

- ``flowtrain batch`` end to end (a subprocess: ETL, linear start, the default model, report), every training
  choice left to flowtrain: the **default** model's test metric and its **linear start**'s (the fitted linear
  model the run reports beside it), and which of the two the run chose;
- scikit-learn's ``HistGradientBoostingClassifier`` / ``Regressor`` with its defaults and (if installed)
  LightGBM's ``LGBMClassifier`` / ``LGBMRegressor`` with its defaults, fitted on the run's own dataset
  directory: the same rows in each split, the same features (standardized numerics, categoricals as their codes,
  declared categorical), evaluated on the same test rows.

The table reports medians over the seeds: AUC (binary), accuracy (K classes), RMSE (regression, label units);
"vs linear" and "vs HGB" are the default's relative differences (positive: better), "within 2% of HGB" is the
issue's goal. ``--tiny``: three small tables, one seed and a short budget (a smoke test of every path).
``--from DIR,...``: print one table from the JSON of earlier runs (``--out``), e.g. tables run one at a time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.quality_tables import TABLES, TINY, Table
from bench.table import report

HIGHER_IS_BETTER = {"auc": True, "accuracy": True, "rmse": False}
WITHIN = 0.02  # the goal: within 2% of HGB's metric


def read_split(dataset: Path, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(numerics, category codes, label, manifest) of one split of a flowtrain dataset directory."""
    manifest = json.loads((dataset / "_manifest.json").read_text())
    table = pa.concat_tables([pq.read_table(dataset / s["file"]) for s in manifest["splits"][name]])
    num = [c for c in table.column_names if c.startswith("num__")]
    cat = [c for c in table.column_names if c.startswith("cat__")]
    x_num = np.stack([table[c].to_numpy() for c in num], axis=1) if num else np.zeros((table.num_rows, 0))
    x_cat = np.stack([table[c].to_numpy() for c in cat], axis=1) if cat else np.zeros((table.num_rows, 0), int)
    return x_num.astype(np.float64), x_cat.astype(np.int64), table["label"].to_numpy().astype(np.float64), manifest


def score(metric: str, y: np.ndarray, predicted: np.ndarray, scale: float = 1.0) -> float:
    """``predicted``: class probabilities (``[N]`` binary, ``[N, K]``) or regression values (in ``y``'s units)."""
    if metric == "auc":
        from sklearn.metrics import roc_auc_score

        return float(roc_auc_score(y, predicted))
    if metric == "accuracy":
        return float(np.mean(np.argmax(predicted, axis=1) == y))
    return float(np.sqrt(np.mean((predicted - y) ** 2))) * scale


def trees(dataset: Path, metric: str, seed: int) -> dict[str, float]:
    """Test metric of HistGradientBoosting (and LightGBM when installed), defaults, on the dataset's splits."""
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    xn, xc, y, manifest = read_split(dataset, "train")
    tn, tc, ty, _ = read_split(dataset, "test")
    x, xt = np.hstack([xn, xc]), np.hstack([tn, tc])
    categorical = [False] * xn.shape[1] + [True] * xc.shape[1]
    regression = metric == "rmse"
    out = {}
    model = (HistGradientBoostingRegressor if regression else HistGradientBoostingClassifier)(
        categorical_features=categorical if any(categorical) else None, random_state=seed).fit(x, y)
    out["hgb"] = _metric_of(model, xt, ty, metric)
    try:
        import lightgbm
    except ImportError:
        return out
    cats = [i for i, c in enumerate(categorical) if c]
    lgbm = (lightgbm.LGBMRegressor if regression else lightgbm.LGBMClassifier)(random_state=seed, verbose=-1)
    lgbm.fit(x, y, categorical_feature=cats or "auto")
    out["lightgbm"] = _metric_of(lgbm, xt, ty, metric)
    return out


def _metric_of(model, x: np.ndarray, y: np.ndarray, metric: str) -> float:
    if metric == "rmse":
        return score(metric, y, model.predict(x))
    proba = model.predict_proba(x)
    return score(metric, y, proba[:, 1] if metric == "auc" else proba)


def flowtrain_run(out: Path, data_args: list[str], seed: int, extra: list[str]) -> dict:
    """One ``flowtrain batch`` run; its summary.json (plus the bench's wall seconds)."""
    cmd = [sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--overwrite", "--out", str(out),
           "--seed", str(seed), *data_args, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"flowtrain batch failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["bench_seconds"] = time.perf_counter() - t0
    return summary


def run_table(table: Table, work: Path, seeds: list[int], tiny: bool, extra: list[str]) -> dict:
    """Every seed of one table: flowtrain's default and linear start, HGB, LightGBM; the per-seed numbers."""
    table_dir = work / table.name
    table_dir.mkdir(parents=True, exist_ok=True)
    data_args = table.prepare(table_dir, tiny)
    metric = table.metric
    runs = []
    for seed in seeds:
        summary = flowtrain_run(table_dir / f"run-{seed}", data_args, seed, extra)
        test = summary["test"]
        training = summary.get("training") or {}
        choice = summary.get("model_choice") or {}
        runs.append({"seed": seed, "default": test["model"][metric], "linear": test["baselines"]["linear model"][metric],
                     **trees(Path(summary["dataset"]), metric, seed),
                     "chosen": choice.get("chosen") or ("linear start" if training.get("best_step") == 0
                                                        else "network"),
                     "rows": summary["rows"], "seconds": summary["bench_seconds"],
                     "train_seconds": training.get("seconds")})
        print(f"quality: {table.name} seed {seed}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in runs[-1].items() if isinstance(v, float) and k != "seconds")
            + f", chosen: {runs[-1]['chosen']}", flush=True)
    return {"table": table.name, "metric": metric, "source": table.source, "split": table.split, "runs": runs}


def tune_table(table: Table, work: Path, trials: int, parallel: int, seed: int, extra: list[str]) -> dict:
    """``flowtrain tune --trials N`` on one table (its split by ``seed``): the best trial's test metric against
    HGB and LightGBM on the study's dataset."""
    table_dir = work / table.name
    table_dir.mkdir(parents=True, exist_ok=True)
    data_args = table.prepare(table_dir, False)
    out = table_dir / f"tune-{seed}"
    cmd = [sys.executable, "-m", "flowtrain.cli", "tune", "--no-progress", "--out", str(out), "--seed", str(seed),
           "--trials", str(trials), "--parallel", str(parallel), *data_args, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=24 * 3600)
    if proc.returncode:
        raise RuntimeError(f"flowtrain tune failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    best = json.loads((out / "best.json").read_text())
    summary = json.loads((Path(best["best"]["run_dir"]) / "summary.json").read_text())
    metric = table.metric
    dataset = out / "dataset" if (out / "dataset" / "_manifest.json").exists() else Path(summary["dataset"])
    return {"table": table.name, "metric": metric, "seed": seed, "trials": trials,
            "tuned": summary["test"]["model"][metric], "best_params": best["best"]["params"],
            "chosen": (summary.get("model_choice") or {}).get("chosen"), **trees(dataset, metric, seed),
            "seconds": time.perf_counter() - t0}


def summarize_tune(results: list[dict]) -> tuple[list[str], list[list], list[str]]:
    headers = ["table", "metric", f"tune best ({results[0]['trials']} trials)", "HGB", "LightGBM", "tuned vs HGB",
               "reaches HGB", "best trial's model", "minutes"]
    rows, reached = [], 0
    for r in results:
        fmt = (lambda v: f"{v:.2f}") if r["metric"] == "rmse" else (lambda v: f"{v:.4f}")
        vs = _relative(r["tuned"], r["hgb"], r["metric"])
        reached += vs >= 0
        rows.append([r["table"], r["metric"], fmt(r["tuned"]), fmt(r["hgb"]),
                     fmt(r["lightgbm"]) if r.get("lightgbm") is not None else "-", f"{vs:+.1%}",
                     "yes" if vs >= 0 else "no", r["chosen"] or "", f"{r['seconds'] / 60:.0f}"])
    notes = [f"`flowtrain tune` reaches or beats HGB's test metric on {reached} of {len(results)} tables (the study "
             "optimizes the validation metric; the test metric is the best trial's reported model's). One split "
             "per table (seed 0); trees fitted on the study's own dataset."]
    return headers, rows, notes


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _relative(a: float, b: float, metric: str) -> float:
    """How much better ``a`` is than ``b``, as a fraction of ``b`` (negative: worse)."""
    return (a - b) / abs(b) if HIGHER_IS_BETTER[metric] else (b - a) / abs(b)


def summarize(results: list[dict]) -> tuple[list[str], list[list], list[str]]:
    headers = ["table", "rows train/valid/test", "metric", "flowtrain default", "linear start", "HGB", "LightGBM",
               "default vs linear", "default vs HGB", "network chosen", "s per run"]
    rows, beats, within = [], 0, 0
    for res in results:
        runs, metric = res["runs"], res["metric"]
        med = {k: _median(runs, k) for k in ("default", "linear", "hgb", "lightgbm", "seconds")}
        vs_linear = _relative(med["default"], med["linear"], metric)
        vs_hgb = _relative(med["default"], med["hgb"], metric)
        beats += vs_linear > 0
        within += vs_hgb >= -WITHIN
        r = runs[0]["rows"]
        fmt = (lambda v: "-" if v is None else f"{v:.2f}") if metric == "rmse" else \
            (lambda v: "-" if v is None else f"{v:.4f}")
        rows.append([res["table"], f"{r['train']:,}/{r['valid']:,}/{r['test']:,}", metric, fmt(med["default"]),
                     fmt(med["linear"]), fmt(med["hgb"]), fmt(med["lightgbm"]), f"{vs_linear:+.1%}",
                     f"{vs_hgb:+.1%}", f"{sum(x['chosen'] == 'network' for x in runs)}/{len(runs)}",
                     f"{med['seconds']:.0f}"])
    n = len(results)
    seeds = sorted({len(res["runs"]) for res in results})
    notes = [f"Medians over {'/'.join(map(str, seeds))} seed(s) per table (a random split's seed is another split; "
             "the demo sample keeps its time split). 'vs' columns: the default's relative difference, positive = "
             "better (for RMSE, lower is better). 'network chosen': seeds whose run kept the network rather than "
             "its linear start (the one-standard-error rule on validation).",
             f"The default beats its linear start on {beats} of {n} tables; it is within {WITHIN:.0%} of HGB's metric "
             f"on {within} of {n}.",
             "Seconds: wall time of one whole `flowtrain batch` run (ETL, linear start, training, report) on a shared "
             "2-core machine, indicative only."]
    return headers, rows, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flowtrain bench quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default=",".join(TABLES),
                        help=f"comma-separated subset of: {', '.join(TABLES)}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per table (default 3; medians are reported)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"smoke test: {', '.join(TINY)} at their small sizes, one seed, --steps 60")
    parser.add_argument("--batch-args", default="", help="more `flowtrain batch` options for every run, e.g. "
                        "--batch-args='--lr 0.002'")
    parser.add_argument("--work", default=None, help="work directory (default: a fixed folder under the temp dir)")
    parser.add_argument("--out", default=None, help="also write the table (quality.md) and every run (quality.json)")
    parser.add_argument("--from", dest="merge", default=None,
                        help="print one table from earlier --out directories (comma-separated); runs nothing")
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                        help="instead: `flowtrain tune --trials TRIALS` per table (seed 0), its best trial against "
                             "HGB and LightGBM")
    parser.add_argument("--parallel", type=int, default=1, help="with --tune: trials at once (default 1)")
    args = parser.parse_args(argv)
    if args.tune:
        names = [t.strip() for t in args.tables.split(",") if t.strip()]
        work = Path(args.work or Path(tempfile.gettempdir()) / "flowtrain-bench-quality")
        results = [tune_table(TABLES[n], work, args.tune, args.parallel, 0, args.batch_args.split()) for n in names]
        headers, rows, notes = summarize_tune(results)
        text = report("quality-tune", headers, rows, notes)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "quality-tune.md").write_text(text + "\n")
            (out / "quality-tune.json").write_text(json.dumps({"runs": results}, indent=1, default=float))
        return
    if args.merge:
        results = [r for d in args.merge.split(",") for r in json.loads((Path(d) / "quality.json").read_text())["runs"]]
    else:
        names = list(TINY) if args.tiny and args.tables == ",".join(TABLES) else \
            [t.strip() for t in args.tables.split(",") if t.strip()]
        unknown = [n for n in names if n not in TABLES]
        if unknown:
            raise SystemExit(f"bench quality: unknown table(s) {', '.join(unknown)}; the tables: {', '.join(TABLES)}")
        seeds = list(range(1 if args.tiny else args.seeds))
        extra = args.batch_args.split() + (["--steps", "60"] if args.tiny else [])
        work = Path(args.work or Path(tempfile.gettempdir()) / "flowtrain-bench-quality")
        results = [run_table(TABLES[n], work, seeds, args.tiny, extra) for n in names]
    headers, rows, notes = summarize(results)
    text = report("quality", headers, rows, notes)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality.md").write_text(text + "\n")
        (out / "quality.json").write_text(json.dumps({"runs": results}, indent=1, default=float))


if __name__ == "__main__":
    main()
